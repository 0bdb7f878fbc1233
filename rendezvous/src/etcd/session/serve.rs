//! Commands: every write the handle asks for, each a few ops with its own answers.

use std::sync::atomic::Ordering;
use std::time::Instant;

use fsdp_proto::v1;

use super::fault::{Fault, FaultKind};
use super::io::{Answer, Command, CommandId, Effect, Op};
use super::machine::{Machine, Phase, Resync, Then};
use super::records;
use crate::etcd::left;
use crate::etcd::record::{Mode, Record};
use crate::{Departure, LeftKind, LeftReason, RendezvousError};

/// A command being served: what it does, at which stage.
#[derive(Debug)]
pub struct Serving {
    id: CommandId,
    job: Job,
}

/// What a command that needs etcd does; each kind carries its own stage, so an op is
/// built only for the stage its kind has.
#[derive(Debug)]
enum Job {
    /// One write ([`Command::Register`], [`Command::Write`], [`Command::Withdraw`]).
    Write(Write),
    /// [`Command::Evict`], checked, said and revoked in turn.
    Evict(Eviction, EvictStage),
    /// [`Command::Depart`]: the revoke, with the records beside it.
    Depart {
        how: crate::Departure,
        why: LeftReason,
    },
}

/// A command's one write, and the leases granted for it when etcd no longer had the
/// one it named.
#[derive(Debug)]
struct Write {
    command: Command,
    /// A registration (or withdrawal) that claims (or gives up) the coordinator key too.
    claiming: bool,
    /// Granting a new lease for it, not writing.
    regranting: bool,
    /// Leases granted for it so far, and when the first was asked for: each one etcd
    /// no longer had when the write with it arrived.
    regrants: u32,
    regranting_since: Option<Instant>,
}

/// A dead agent's lease to revoke ([`Command::Evict`]).
#[derive(Debug)]
struct Eviction {
    node: String,
    lease: i64,
    round: u64,
    detect_ms: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EvictStage {
    /// Does the dead node's registration still live on that lease?
    CheckHeld,
    SayNoticed,
    Revoke,
}

impl Serving {
    /// Whether its op may be sent a second time after an overloaded answer that may have
    /// applied it. Not a withdrawal: it deletes the coordinator key whoever holds it, and
    /// a member in turn may have claimed it meanwhile.
    pub(super) fn retry_safe(&self) -> bool {
        !matches!(&self.job, Job::Write(w) if matches!(w.command, Command::Withdraw { .. }))
    }

    /// The command, to be answered with the others waiting (the session is ending).
    pub(super) fn into_waiting(self) -> (CommandId, Command) {
        let command = match self.job {
            Job::Write(w) => w.command,
            Job::Evict(e, _) => Command::Evict {
                node: e.node,
                lease: e.lease,
                round: e.round,
                detect_ms: e.detect_ms,
            },
            Job::Depart { how, why } => Command::Depart { how, why },
        };
        (self.id, command)
    }

    /// What its current op is doing, for its error.
    fn what(&self) -> &'static str {
        match &self.job {
            Job::Write(w) if w.regranting => "granting a new membership lease",
            Job::Write(w) => match &w.command {
                Command::Register { .. } => <v1::Member as Record>::WRITING,
                Command::Write(o) => o.writing,
                _ => <v1::Unhealthy as Record>::WRITING,
            },
            Job::Evict(_, EvictStage::CheckHeld) => "checking a dead agent's lease",
            Job::Evict(_, EvictStage::SayNoticed) => "recording how a dead agent was found",
            Job::Evict(_, EvictStage::Revoke) => "revoking a dead agent's lease",
            Job::Depart { .. } => "leaving the run",
        }
    }
}

impl Machine {
    pub(super) fn serve(&mut self, id: CommandId, command: Command) {
        let job = match command {
            Command::Running { round } => {
                self.me.runs(Some(round));
                // Formation is over for this node: its requests go unpaced, so that a
                // re-form never waits. Not at its registration: a crowd's registered nodes
                // whose streams broke read the run again, each read one more request to an
                // etcd already behind, and at 10,000 nodes those unpaced reads kept etcd
                // from ever draining (no round in 150 s; 53,000 reads "took too long").
                let first = !self.admission.formation_over();
                self.admission.ran_a_round();
                if first && !self.outage.members_known() {
                    // A crowd's node, which did not ask at its join: soon if it looks
                    // (the look waits for the count), else spread from half a TTL on,
                    // away from the seal's own requests (`count_delay`).
                    let delay = if self.outage.looks() {
                        std::time::Duration::ZERO
                    } else {
                        let max = self.cfg.seal.max_nodes;
                        super::outage::count_delay(&self.cfg.node_id, max, self.cfg.ttl)
                    };
                    self.outage.count_members_at(self.now + delay);
                } else if first && self.outage.looks() && self.look_may_run() {
                    // The look held back while forming starts now that workers run,
                    // unless etcd said since that the lease stands, or was counted
                    // more than one member (no look proves anything there).
                    self.flight.emit(Effect::Probe(true));
                }
                return self.served(id, false, Ok(()));
            }
            Command::Abandon { reason } => {
                let why = LeftReason::new(LeftKind::Fenced, reason);
                let word = self.own_word(&why);
                self.me.fenced(word);
                return self.served(id, false, Ok(()));
            }
            Command::Register { wants_round } => {
                // Joining a round means the last one is over for this node.
                self.me.runs(None);
                self.me.set_member(Some(self.member_record(wants_round)));
                if self.registration_stands(wants_round) {
                    return self.served(id, false, Ok(()));
                }
                let claiming = self.view.coordinator.is_none();
                Job::Write(Write::new(command, claiming))
            }
            Command::Withdraw { .. } => {
                // Out of every round until it registers again: nothing of ours to put
                // back, and the next registration is a new incarnation. Whether it
                // coordinates is read before the write.
                let claiming = self.view.coordinator.as_deref() == Some(&self.cfg.node_id);
                self.me.set_member(None);
                self.me.runs(None);
                self.next_incarnation();
                Job::Write(Write::new(command, claiming))
            }
            Command::Write(_) => Job::Write(Write::new(command, false)),
            Command::Evict {
                node,
                lease,
                round,
                detect_ms,
            } => {
                if self.view.departed.contains_key(&node) {
                    // It left (or its lease went) before the proof came: nothing to add.
                    return self.served(id, false, Ok(()));
                }
                let stage = if crate::switches::OLD_EVICTIONS.with(std::cell::Cell::get) {
                    EvictStage::SayNoticed
                } else {
                    EvictStage::CheckHeld
                };
                let eviction = Eviction {
                    node,
                    lease,
                    round,
                    detect_ms,
                };
                Job::Evict(eviction, stage)
            }
            Command::Depart { how, why } => Job::Depart { how, why },
        };
        self.next_op(Serving { id, job });
    }

    /// Whether asking for round `wants` needs no write: this node's registration is still
    /// in etcd as written, and the coordinator seals it in without one
    /// ([`registration_stands`](crate::etcd::joining::registration_stands)).
    fn registration_stands(&self, wants: u64) -> bool {
        let (me, incarnation) = (self.cfg.node_id.as_str(), self.lease.incarnation());
        let gone = self
            .view
            .departed
            .get(me)
            .is_some_and(|d| d.incarnation >= incarnation);
        self.me.written_with(self.lease.id(), incarnation)
            && !gone
            && crate::etcd::joining::registration_stands(&self.view, me, incarnation, wants)
    }

    /// Sends the op of `s`'s stage.
    fn next_op(&mut self, s: Serving) {
        let op = match &s.job {
            Job::Write(w) if w.regranting => Op::Grant {
                ttl: self.cfg.ttl.as_secs().max(1) as i64,
            },
            Job::Write(w) => self.write_op(w),
            Job::Evict(e, stage) => match stage {
                // Only while `lease` is still the one its registration lives on: the
                // proof is about the process that held it. A node that registered again
                // (a new incarnation), or a store restarted empty that handed the id to
                // someone else, is not what was found dead, and revoking it would evict
                // a live agent.
                EvictStage::CheckHeld => {
                    Op::Txn(records::lease_holds(&self.cfg.keys, &e.node, e.lease))
                }
                EvictStage::SayNoticed => {
                    let g = records::noticed(e.round, &e.node, v1::Detection::Refused, e.detect_ms);
                    Op::Txn(records::say_noticed(&self.cfg.keys, &g))
                }
                EvictStage::Revoke => Op::Revoke { lease: e.lease },
            },
            Job::Depart { how, why } => {
                let op = self.depart_op(*how, why);
                // A node that leaves needs no more news of the run (the session ends with
                // the answer). When a whole run leaves at once (a job deleted), each watch
                // left open got every other node's departure: a million events for 1,000
                // nodes, seconds of etcd's and the agents' CPU.
                self.close_watches();
                op
            }
        };
        self.issue(Then::Command(s), op);
    }

    /// The one write a command makes, with the current lease and incarnation.
    fn write_op(&self, w: &Write) -> Op {
        let (keys, me, lease) = (&self.cfg.keys, self.cfg.node_id.as_str(), self.lease.id());
        match &w.command {
            Command::Write(o) => records::write(keys, o, lease),
            Command::Withdraw { record } => {
                Op::Txn(records::withdrawal(keys, me, record, lease, w.claiming))
            }
            // `Write::new` is given these three only: a registration is the rest.
            _ => Op::Txn(records::registration(
                keys,
                me,
                self.me.member(),
                (lease, self.lease.incarnation()),
                w.claiming,
            )),
        }
    }

    /// Revoking deletes our registration (and the coordinator key if we held it), so the
    /// others learn within milliseconds instead of a lease TTL. The others learn how (a
    /// leave, not a death) and status why, from records sent beside the revoke, not before
    /// it: under load one more round trip first would delay what every survivor waits for.
    ///
    /// A node of a round its members know broke already says nothing ([`left::news`]);
    /// nor does one whose word etcd finds was not the first after the round's seal
    /// ([`records::say_left`]: members leaving together each think theirs news).
    fn depart_op(&self, how: Departure, why: &LeftReason) -> Op {
        let lease = self.lease.id();
        let incarnation = self.lease.incarnation();
        let me = &self.cfg.node_id;
        let mine = (self.view.round.as_ref())
            .filter(|r| crate::etcd::joining::names(&r.record, me, incarnation));
        if mine.is_some_and(|r| !left::news(&self.view, r, &self.cfg.node_id)) {
            return Op::Depart {
                record: None,
                lease,
            };
        }
        let gone = match (how, self.me.running()) {
            (Departure::Left, Some(r)) => Some(records::noticed(
                r.number,
                &self.cfg.node_id,
                v1::Detection::Left,
                0,
            )),
            _ => None,
        };
        // A node that fenced itself and leaves before it could say so says that: the
        // departure goes before the sync's word (`Flight::leave`), and the fence is why
        // its registration went.
        let word = self
            .me
            .fenced_word()
            .cloned()
            .unwrap_or_else(|| self.own_word(why));
        let trim = left::trim(&self.view.left, Some(&word.tail()));
        Op::Depart {
            record: Some(records::say_left(
                &self.cfg.keys,
                &word,
                gone.as_ref(),
                &trim,
                // A finish breaks nothing (`left::breakers`): every finishing node's word
                // is news, and fenced, the others would be called lost at a run's end.
                mine.filter(|_| left::kind_of(&word) != Some(crate::LeftKind::Finished))
                    .map(|r| r.mod_rev),
            )),
            lease,
        }
    }

    pub(super) fn on_command_answer(&mut self, s: Serving, answer: Result<Answer, Fault>) {
        let Serving { id, job } = s;
        match job {
            Job::Write(w) => self.on_write_answer(id, w, answer),
            Job::Evict(e, stage) => {
                let (node, lease, round) = (e.node.clone(), e.lease, e.round);
                let next = |stage| Job::Evict(e, stage);
                match (stage, answer) {
                    (EvictStage::CheckHeld, Ok(Answer::Txn { succeeded: false })) => {
                        tracing::info!(%node, lease, "the dead agent's lease no longer holds its registration; nothing to revoke");
                        self.served(id, false, Ok(()));
                    }
                    (EvictStage::CheckHeld, Ok(_)) => {
                        // How it went is no news to the members of a round they know
                        // broke ([`left::news`]): its lease is revoked at once, so that
                        // the next round is sealed without its registration.
                        let said = self
                            .view
                            .round
                            .as_ref()
                            .filter(|r| r.record.number == round);
                        let news = said.is_none_or(|r| left::news(&self.view, r, &node));
                        let stage = if news {
                            EvictStage::SayNoticed
                        } else {
                            EvictStage::Revoke
                        };
                        self.next_op(Serving {
                            id,
                            job: next(stage),
                        });
                    }
                    (EvictStage::SayNoticed, Ok(_)) => {
                        self.wrote();
                        let job = next(EvictStage::Revoke);
                        self.next_op(Serving { id, job });
                    }
                    (EvictStage::Revoke, r)
                        if r.as_ref().is_ok()
                            || r.as_ref()
                                .is_err_and(|e| e.kind == FaultKind::LeaseNotFound) =>
                    {
                        if r.is_ok() {
                            self.wrote();
                        }
                        tracing::info!(%node, lease, "revoked the lease of a dead agent");
                        self.served(id, false, Ok(()));
                    }
                    (_, Ok(other)) => self.unexpected(&other),
                    (stage, Err(e)) => {
                        let s = Serving {
                            id,
                            job: next(stage),
                        };
                        self.command_failed(s, e)
                    }
                }
            }
            Job::Depart { .. } => self.on_depart_answer(id, answer),
        }
    }

    /// The answer to a command's one write (or to the grant of a lease for it).
    fn on_write_answer(&mut self, id: CommandId, mut w: Write, answer: Result<Answer, Fault>) {
        let uses_lease = match &w.command {
            Command::Register { .. } => true,
            Command::Write(o) => o.mode == Mode::Leased,
            _ => false,
        };
        let register = matches!(w.command, Command::Register { .. });
        match answer {
            // etcd no longer has the lease (this agent was frozen past its TTL, or etcd
            // lost it): a new one, and the write again with it, so the agent rejoins as a
            // new incarnation instead of exiting.
            Err(e) if !w.regranting && uses_lease && e.kind == FaultKind::LeaseNotFound => {
                self.lease_gone();
                self.regrant(id, w, e);
            }
            Ok(Answer::Granted { id: lease }) if w.regranting => {
                self.lease_renewed(lease);
                w.regranting = false;
                self.next_op(Serving {
                    id,
                    job: Job::Write(w),
                });
            }
            Ok(answer) if !w.regranting => {
                self.wrote();
                if register {
                    self.registered();
                }
                let won = matches!(answer, Answer::Txn { succeeded: true });
                if register && w.claiming && won {
                    self.elected();
                }
                self.served(id, false, Ok(()));
            }
            Ok(other) => self.unexpected(&other),
            Err(e) => self.command_failed(
                Serving {
                    id,
                    job: Job::Write(w),
                },
                e,
            ),
        }
    }

    /// The depart op itself never fails; only the driver's deadline can end it so.
    /// Leaving is not retried after a re-sync: that would register the leaving node again
    /// (its lease lapsed while the op hung) and could make it coordinator.
    fn on_depart_answer(&mut self, id: CommandId, answer: Result<Answer, Fault>) {
        match answer {
            Ok(Answer::Departed { said, revoked }) => {
                if let Some(e) = said {
                    tracing::debug!(error = %e, "could not record the leave");
                }
                match revoked {
                    None => self.wrote(),
                    // Gone already (its keep-alives stopped with the watches, before the
                    // departure, and it expired meanwhile; or a ring neighbour evicted it):
                    // gone is what a revoke does.
                    Some(e) if e.kind == FaultKind::LeaseNotFound => {}
                    Some(e) => {
                        tracing::warn!(error = %e, "could not revoke the lease; peers will notice after its TTL")
                    }
                }
            }
            Ok(other) => return self.unexpected(&other),
            Err(e) => {
                tracing::warn!(error = %e, "could not leave in words; peers will notice after its TTL");
            }
        }
        self.served(id, true, Ok(()));
    }

    /// The lease `w` named was gone: the first time, a new one at once. A fresh lease
    /// that expired too before the write with it landed says the writes wait in etcd (or
    /// in this process) longer than a TTL: the next grant waits a backoff, as an
    /// overloaded answer's retry does, so that 10,000 agents regranting add no load
    /// faster than etcd drains it; past the outage bound the refusal is the answer.
    fn regrant(&mut self, id: CommandId, mut w: Write, source: Fault) {
        let now = self.now;
        let since = *w.regranting_since.get_or_insert(now);
        w.regrants += 1;
        let regrants = w.regrants;
        if now - since > self.cfg.outage_limit {
            // The write's own error: it is what could not be done.
            let what = Serving {
                id,
                job: Job::Write(w),
            }
            .what();
            return self.served(id, false, Err(RendezvousError::Etcd { what, source }));
        }
        w.regranting = true;
        let s = Serving {
            id,
            job: Job::Write(w),
        };
        if regrants == 1 {
            return self.next_op(s);
        }
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        let delay = self.retry_delay(regrants - 2);
        tracing::warn!(
            leases = regrants - 1,
            retry_in = ?delay,
            "a new lease expired before the write with it reached etcd; granting another after a backoff"
        );
        let op = Op::Grant {
            ttl: self.cfg.ttl.as_secs().max(1) as i64,
        };
        self.flight.retry_at(now + delay, Then::Command(s), op);
    }

    /// A command's op failed: a transient failure keeps the command for after the next
    /// sync (never answered with it); anything else is its answer.
    fn command_failed(&mut self, s: Serving, source: Fault) {
        let what = s.what();
        if source.transient {
            tracing::warn!(error = %source, "{what} failed; retrying after reconnecting");
            self.flight.wait_first(s.into_waiting());
            return self.lost(source);
        }
        self.served(s.id, false, Err(RendezvousError::Etcd { what, source }));
    }

    /// Command `id` is answered; what follows depends on the phase. A departure ends the
    /// session.
    fn served(&mut self, id: CommandId, departed: bool, result: Result<(), RendezvousError>) {
        self.reply(id, result);
        if departed {
            return self.end();
        }
        if let Phase::Watching { lease, .. } = self.phase {
            if self.lease.id() != lease || self.me.abandoning() {
                self.resync_after_watching(Resync::Outage);
            } else {
                // A registration may have won the coordinator key.
                self.role_check();
            }
        }
    }
}

impl Write {
    fn new(command: Command, claiming: bool) -> Self {
        Self {
            command,
            claiming,
            regranting: false,
            regrants: 0,
            regranting_since: None,
        }
    }
}
