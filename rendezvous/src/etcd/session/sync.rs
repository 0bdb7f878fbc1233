//! The steps of a sync (a ranged read to open watches) and the other work the machine
//! queues: each a [`Todo`] that runs at once or sends one op and goes on with its answer.

use super::fault::{Fault, FaultKind};
use super::io::{Answer, Kv, Op, Role};
use super::machine::{Machine, Phase, Resync, Then};
use super::rebuild::{fresh_view, put_kv};
use super::records;

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
    /// As coordinator of a forming crowd: how far it may go ([`super::turn::Frontier`]).
    Admit,
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
    /// This node's shard of the placed round it waits on, read again from the leader's
    /// state: the first read's member had not yet applied the header.
    ReadShardAgain,
    /// This node's shard of the placed round it waits on is gone: read the round key, to
    /// tell a newer seal (which deleted it) from keys no agent wrote.
    ReadSeal,
    /// The keep-alive stream ended (etcd too busy): a new one, the watches kept.
    ReopenKeepAlive,
    /// A joining node's keep-alive stream, opened right after its grant, before its
    /// first sync ([`super::admission`]).
    KeepFromGrant,
    /// A keep-alive is late: ask etcd how long the lease has left. A renewal that was
    /// only slow (a busy machine, a busy etcd) then moves the lease clock, and the node
    /// is not fenced or counted lost while etcd says its lease stands.
    AskLease,
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
            // writes (a third of its CPU at formation). A lease that expired
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
        let op = match todo {
            Todo::SayFenced => return self.say_fenced(),
            Todo::SayLost => return self.say_lost(),
            Todo::Admit => return self.admit(),
            Todo::Coordinate => return self.coordinate(),
            Todo::Drain => return self.drain(),
            Todo::Enter => return self.enter(),
            Todo::RoleCheck => return self.role_check(),
            Todo::Resync(why) => return self.begin_sync(why),
            Todo::OpenWatches => return self.open_watches(),
            Todo::Read if self.takes_first_read() => {
                let read = self.first_read.take().expect("checked");
                return self.on_read(read.revision, &read.kvs);
            }
            // A keep-alive queued before the stream ended goes on a new one.
            Todo::KeepAlive if self.lease.stream_ended() => {
                self.flight.first(Todo::KeepAlive);
                let op = Op::ReopenKeepAlive {
                    lease: self.watches.lease(),
                };
                return self.issue(Then::Todo(Todo::ReopenKeepAlive), op);
            }
            _ => self.op_of(todo),
        };
        if let Some(op) = op {
            self.issue(Then::Todo(todo), op);
        }
    }

    /// The op a step sends, if it has one to send now.
    fn op_of(&self, todo: Todo) -> Option<Op> {
        let keys = &self.cfg.keys;
        let ttl = self.cfg.ttl.as_secs().max(1) as i64;
        let op = match todo {
            Todo::PickEndpoint => Op::PickEndpoint,
            Todo::RevokeFenced => Op::Revoke {
                lease: self.lease.id(),
            },
            Todo::Grant => Op::Grant { ttl },
            Todo::ReadOwn => range(keys.key::<fsdp_proto::v1::Member>(&self.cfg.node_id), false),
            // A member reads what it watches: the control keys (and then its own
            // registration). The whole run holds every registration, and N members each
            // reading it — N joiners at formation, or every node after etcd was too slow
            // for their streams — was O(N²) bytes from etcd exactly when it was busiest
            // (10,000 nodes: gigabytes).
            Todo::Read if self.control_read() => snapshot(keys.ctl()),
            Todo::Read => snapshot(keys.root().to_owned()),
            Todo::CountMembers => Op::MemberCount,
            // Learnt with the question (`phases.rs`): a question to an etcd of several
            // members is not asked.
            Todo::AskLease if !self.outage.may_be_single() => return None,
            Todo::CheckLease | Todo::AskLease => Op::TimeToLive {
                lease: self.lease.id(),
            },
            Todo::Register => Op::Txn(records::registration(
                keys,
                &self.cfg.node_id,
                Some(self.me.member()?),
                (self.lease.id(), self.lease.incarnation()),
                false,
            )),
            Todo::Republish => Op::Txn(records::first_word(
                keys.key::<fsdp_proto::v1::Round>(""),
                fsdp_proto::encode(self.me.round_to_put_back()?),
                &[],
            )),
            Todo::Campaign if self.view.coordinator.is_some() || self.me.member().is_none() => {
                return None;
            }
            Todo::Campaign => Op::Txn(records::registration(
                keys,
                &self.cfg.node_id,
                None,
                (self.lease.id(), 0),
                true,
            )),
            Todo::CheckAbsent => {
                self.me.running()?;
                Op::Range {
                    key: keys.members(),
                    prefix: true,
                    keys_only: true,
                    serializable: false,
                }
            }
            Todo::ReadRoster => {
                let wanted = self.view.round_wanted?;
                if let Some(read) = self.placement_read(wanted, false) {
                    return Some(read);
                }
                tracing::debug!(
                    wanted,
                    "a round came as a delta of one not held; reading the roster"
                );
                range(keys.key::<fsdp_proto::v1::Roster>(""), false)
            }
            Todo::ReadSeal => range(keys.key::<fsdp_proto::v1::Round>(""), false),
            Todo::ReadShardAgain => self.placement_read(self.view.round_wanted?, true)?,
            Todo::KeepAlive => Op::KeepAlive,
            Todo::ReopenKeepAlive => Op::ReopenKeepAlive {
                lease: self.watches.lease(),
            },
            Todo::KeepFromGrant => Op::ReopenKeepAlive {
                lease: self.lease.id(),
            },
            // Steps without an op of their own (`run` does them).
            Todo::SayFenced
            | Todo::SayLost
            | Todo::Admit
            | Todo::OpenWatches
            | Todo::Coordinate
            | Todo::Drain
            | Todo::Enter
            | Todo::RoleCheck
            | Todo::Resync(_) => return None,
        };
        Some(op)
    }

    /// Whether this step's read is the one the handle made before the grant: as a member
    /// reading the control keys (any sync but the first has dropped it: `begin_sync`).
    fn takes_first_read(&self) -> bool {
        self.first_read.is_some() && self.control_read()
    }

    fn open_watches(&mut self) {
        let (role, lease) = (self.role(), self.lease.id());
        // A joining node's stream kept from the grant goes on under the watches, unless
        // it ended (the driver hands its end over before the machine's next op, so an
        // end not read yet waits in the inbox); any other is replaced by the open's.
        let keep_stream = self.lease.kept_from_grant() == Some(lease)
            && !self.lease.stream_ended()
            && !self.flight.inbox().holds_keep_alive_end();
        // What a stream the open closes said and the machine has not read yet belongs
        // to that stream (read after it, an end of that stream would end the new
        // watches).
        if self.lease.kept_from_grant().is_some() && !keep_stream {
            self.flight.drop_keep_alive_events();
        }
        if self.watches.control_only() && self.role() == Role::Coordinator {
            // Elected during this sync (a campaign after an outage) on a view without
            // registrations: read them all before watching as the coordinator (found by
            // the simulator: a coordinator that never sealed, seed 275).
            self.watches.read_whole();
            self.flight.first(Todo::OpenWatches);
            self.flight.first(Todo::Read);
            return;
        }
        self.watches.opening(role, lease);
        if !keep_stream {
            // The open replaces every stream, an early keep-alive's too (and, if etcd
            // refuses it, leaves none until it is sent again).
            self.lease.kept_from_grant_over();
        }
        let from = self.watches.read_rev() + 1;
        let op = Op::Watch {
            role,
            from,
            lease,
            keep_stream,
        };
        self.issue(Then::Todo(Todo::OpenWatches), op);
    }

    pub(super) fn on_todo_answer(&mut self, todo: Todo, answer: Result<Answer, Fault>) {
        let answer = match (todo, answer) {
            (Todo::SayFenced | Todo::SayLost, Err(e)) => return self.word_failed(todo, e),
            (Todo::Admit, Err(e)) => return self.admit_failed(e),
            // A fenced lease that expired meanwhile is gone either way.
            (Todo::RevokeFenced, Err(e)) if e.kind == FaultKind::LeaseNotFound => Answer::Done,
            (_, Err(e)) => return self.lost(e),
            (_, Ok(a)) => a,
        };
        match (todo, answer) {
            (Todo::PickEndpoint, _) => self.outage.set_reselect(false),
            (Todo::SayFenced, Answer::Txn { .. }) => {
                self.wrote();
                self.me.word_done();
            }
            (Todo::SayLost, Answer::Txn { succeeded }) => self.said_lost(succeeded),
            (Todo::Admit, Answer::Done) => self.admitted(),
            (Todo::RevokeFenced, _) => self.revoked_fenced(),
            (Todo::Grant, Answer::Granted { id }) => self.lease_renewed(id),
            (Todo::ReadOwn, Answer::Range { kvs, .. }) => {
                let keys = self.cfg.keys.clone();
                let v = self.view.edit();
                for kv in &kvs {
                    put_kv(v, &keys, kv);
                }
            }
            (Todo::Read, Answer::Range { revision, kvs }) => self.on_read(revision, &kvs),
            (Todo::CountMembers, Answer::MemberCount(n)) => self.counted(n),
            (Todo::CheckLease, Answer::TimeToLive { ttl }) => self.ensure_registered(ttl),
            (Todo::AskLease, Answer::TimeToLive { ttl }) if ttl > 0 => {
                self.lease_left(ttl);
                self.lease_spoken_for();
            }
            // Less than a second left: nothing to move the clock by; the keep-alives go on.
            (Todo::AskLease, Answer::TimeToLive { ttl: 0 }) => {}
            (Todo::AskLease, Answer::TimeToLive { .. }) => {
                self.lease_spoken_for();
                self.lease_expired();
            }
            (Todo::Register, Answer::Txn { .. }) => {
                self.wrote();
                self.registered();
            }
            (Todo::Republish, Answer::Txn { succeeded }) => self.republished(succeeded),
            (Todo::Campaign, Answer::Txn { succeeded }) => {
                self.wrote();
                if succeeded {
                    self.elected();
                }
            }
            // The keep-alives sent on an ended stream will never be answered: the next
            // answer must be matched with a keep-alive sent on the new one.
            // A stream kept from the grant under the new watches is still the one its
            // keep-alives went on.
            (Todo::OpenWatches, Answer::Done) if self.lease.kept_from_grant().is_some() => {}
            (Todo::OpenWatches | Todo::ReopenKeepAlive, Answer::Done) => {
                self.lease.stream_opened();
            }
            (Todo::KeepFromGrant, Answer::Done) => {
                self.lease.stream_opened();
                self.lease.keep_from_grant(self.now, self.cfg.ttl);
            }
            (Todo::CheckAbsent, Answer::Range { kvs, .. }) => self.check_absent(&kvs),
            (Todo::ReadRoster, Answer::Range { kvs, revision }) => {
                self.read_roster(&kvs, Some(revision))
            }
            // Linearizable: it has the header (no "behind" to tell).
            (Todo::ReadShardAgain, Answer::Range { kvs, .. }) => self.read_roster(&kvs, None),
            (Todo::ReadSeal, Answer::Range { kvs, .. }) => self.read_seal(&kvs),
            (Todo::KeepAlive, Answer::Done) => {}
            (_, other) => self.unexpected(&other),
        }
    }

    /// The fenced lease was revoked.
    fn revoked_fenced(&mut self) {
        self.wrote();
        tracing::info!(lease = self.lease.id(), "revoked the fenced lease");
        // Its registration went with the lease: a round sealed from it (before the
        // others saw it go) is not one this agent can run.
        let (me, went, now) = (self.cfg.node_id.clone(), self.lease.incarnation(), self.now);
        self.view.edit().depart(&me, went, now);
        self.me.abandoned();
        self.flight.first(Todo::Grant);
    }

    /// The ranged read of this sync, at `revision`.
    fn on_read(&mut self, revision: i64, kvs: &[Kv]) {
        let control_only = self.control_read();
        let fresh = fresh_view(self, kvs);
        if control_only && fresh.coordinator.as_deref() == Some(&*self.cfg.node_id) {
            // An earlier run of this node still holds the role: a coordinator needs every
            // registration.
            self.watches.read_whole();
            self.flight.first(Todo::Read);
            return;
        }
        self.watches.read(revision, control_only);
        let voluntary = matches!(self.phase, Phase::Syncing(Resync::RoleChanged { .. }));
        self.install(fresh, voluntary);
        if control_only && self.phase != Phase::Syncing(Resync::First) {
            // Whether this node is still registered decides what the sync does next (a
            // joining node registers when it joins).
            self.flight.first(Todo::ReadOwn);
        }
        if control_only && self.view.round_wanted.is_some() {
            // The round key holds a difference, or a placed round's header: the whole
            // round is at the roster, or this node's part in its shard, outside the
            // control keys.
            self.flight.first(Todo::ReadRoster);
        } else if let Some(header) = self.view.placing.clone() {
            // A whole read has every shard of a placed round already.
            let placements = self.cfg.keys.placement_of(&header.record.placement);
            let shards: Vec<Kv> = kvs
                .iter()
                .filter(|kv| kv.key.starts_with(&placements))
                .cloned()
                .collect();
            self.read_placement(header, &shards, None);
        }
    }

    fn republished(&mut self, succeeded: bool) {
        self.wrote();
        if !succeeded {
            return;
        }
        // The field only when there is a number: `round=Some(0)` is Rust's text, not a
        // person's.
        match self.me.round_to_put_back().map(|r| r.number) {
            Some(round) => tracing::info!(
                round,
                "etcd lost the round record; put the newest round it knew back"
            ),
            None => {
                tracing::info!("etcd lost the round record; put the newest round it knew back")
            }
        }
    }

    /// The read of placed round `wanted`'s placement, if its header is what the view
    /// waits on: a member reads its own shard; a view that coordinates, every one.
    ///
    /// A member's read is serializable: at a seal every member of the round reads at
    /// once (10,000 at 10,000 nodes, within a second), and etcd 3.4 holds each
    /// linearizable read until its apply loop has caught up, the moment its apply loop is
    /// busiest with the seal's own writes. Served from a member that had not yet applied
    /// the header, the answer's revision says so, and the shard is read again from the
    /// leader's state (`again`, [`Todo::ReadShardAgain`]).
    fn placement_read(&self, wanted: u64, again: bool) -> Option<Op> {
        let placing = self.view.placing.as_ref().map(|p| &p.record);
        let header = placing.filter(|h| h.number == wanted)?;
        let keys = &self.cfg.keys;
        Some(if self.watches.control_only() {
            let shard = crate::etcd::placement::shard_of(&self.cfg.node_id, header.shards);
            Op::Range {
                key: keys.placement(&header.placement, shard),
                prefix: false,
                keys_only: false,
                serializable: !again,
            }
        } else {
            range(keys.placement_of(&header.placement), true)
        })
    }
}

/// A ranged read of `key` (with `prefix`: every key under it).
fn range(key: String, prefix: bool) -> Op {
    Op::Range {
        key,
        prefix,
        keys_only: false,
        serializable: false,
    }
}

/// The sync's read of every key under `prefix`: a snapshot at its revision, from which
/// the watches go on (see [`Op::Range`]'s `serializable`).
fn snapshot(prefix: String) -> Op {
    Op::Range {
        key: prefix,
        prefix: true,
        keys_only: false,
        serializable: true,
    }
}
