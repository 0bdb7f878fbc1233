//! Commands: every write the handle asks for, each a few ops with its own answers.

use std::sync::atomic::Ordering;
use std::time::Instant;

use fsdp_proto::{SCHEMA_VERSION, v1};

use super::io::{Answer, Command, CommandId, Op};
use super::machine::{Machine, Phase, Resync, Then};
use super::records;
use crate::etcd::connect::transient;
use crate::etcd::left;
use crate::etcd::record::{Mode, Record};
use crate::etcd::session::lease_not_found;
use crate::{Departure, LeftKind, LeftReason, RendezvousError};

/// A command being served.
#[derive(Debug)]
pub struct Serving {
    id: CommandId,
    command: Command,
    stage: Stage,
    /// A registration that claims the coordinator key too.
    claiming: bool,
    /// Leases granted for it so far, and when the first was asked for: each one etcd
    /// no longer had when the write with it arrived.
    regrants: u32,
    regranting_since: Option<Instant>,
}

impl Serving {
    /// Whether its op may be sent a second time after an overloaded answer that may have
    /// applied it. Not a withdrawal: it deletes the coordinator key whoever holds it, and
    /// a member in turn may have claimed it meanwhile.
    pub(super) fn retry_safe(&self) -> bool {
        !matches!(self.command, Command::Withdraw { .. })
    }

    /// The command, to be answered with the others waiting (the session is ending).
    pub(super) fn into_waiting(self) -> (CommandId, Command) {
        (self.id, self.command)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// The command's write.
    Write,
    /// etcd no longer had the lease the write named: a new one.
    Regrant,
    /// Eviction: does the dead node's registration still live on that lease?
    CheckHeld,
    SayGone,
    Revoke,
    Depart,
}

impl Machine {
    pub(super) fn serve(&mut self, id: CommandId, command: Command) {
        let mut s = Serving {
            id,
            command,
            stage: Stage::Write,
            claiming: false,
            regrants: 0,
            regranting_since: None,
        };
        match &s.command {
            Command::Running { round } => {
                self.running = Some(round.clone());
                return self.served(s, Ok(()));
            }
            Command::Abandon { reason } => {
                let why = LeftReason::new(LeftKind::Fenced, reason.clone());
                self.fenced_word = Some(self.own_word(&why));
                self.running = None;
                self.abandon = true;
                return self.served(s, Ok(()));
            }
            Command::Register { wants_round } => {
                // Joining a round means the last one is over for this node.
                self.running = None;
                self.member = Some(self.member_record(*wants_round));
                if self.registration_stands(*wants_round) {
                    return self.served(s, Ok(()));
                }
                s.claiming = self.view.coordinator.is_none();
            }
            Command::Withdraw { .. } => {
                // Out of every round until it registers again: nothing of ours to put
                // back, and the next registration is a new incarnation. Whether it
                // coordinates is read before the write.
                s.claiming = self.view.coordinator.as_deref() == Some(&self.cfg.node_id);
                self.member = None;
                self.running = None;
                self.next_incarnation();
            }
            Command::Evict { node, .. } => {
                if self.view.departed.contains_key(node) {
                    // It left (or its lease went) before the proof came: nothing to add.
                    return self.served(s, Ok(()));
                }
                s.stage = if crate::switches::OLD_EVICTIONS.with(std::cell::Cell::get) {
                    Stage::SayGone
                } else {
                    Stage::CheckHeld
                };
            }
            Command::Depart { .. } => s.stage = Stage::Depart,
            _ => {}
        }
        self.next_op(s);
    }

    /// Whether asking for round `wants` needs no write: this node's registration is still
    /// in etcd as written, and the coordinator seals it in without one
    /// ([`registration_stands`](crate::etcd::joining::registration_stands)).
    fn registration_stands(&self, wants: u64) -> bool {
        let (me, incarnation) = (self.cfg.node_id.as_str(), self.incarnation);
        let gone = self
            .view
            .departed
            .get(me)
            .is_some_and(|d| d.incarnation >= incarnation);
        self.written == Some((self.lease, incarnation))
            && !gone
            && crate::etcd::joining::registration_stands(&self.view, me, incarnation, wants)
    }

    fn member_record(&self, wants_round: u64) -> v1::Member {
        v1::MemberFields {
            schema: SCHEMA_VERSION,
            node_id: self.cfg.node_id.clone(),
            addr: self.cfg.addr.clone(),
            local_world_size: self.cfg.local_world_size,
            wants_round,
            status_addr: self.cfg.status_addr.clone(),
            // Set to the lease and incarnation it is written with (`registration`).
            lease: 0,
            incarnation: 0,
            min_nodes: self.cfg.seal.min_nodes,
            max_nodes: self.cfg.seal.max_nodes,
            max_restarts: self.cfg.budget.max_restarts,
            restart_window_s: self.cfg.budget.window_s,
            job: self.cfg.job.clone(),
        }
        .into()
    }

    /// Sends the op of `s`'s stage.
    fn next_op(&mut self, s: Serving) {
        let op = match s.stage {
            Stage::Write => self.write_op(&s),
            Stage::Regrant => Op::Grant {
                ttl: self.cfg.ttl.as_secs().max(1) as i64,
            },
            Stage::CheckHeld | Stage::SayGone | Stage::Revoke => self.evict_op(&s),
            Stage::Depart => self.depart_op(&s),
        };
        self.issue(Then::Command(s), op);
    }

    /// The one write a command makes, with the current lease and incarnation.
    fn write_op(&self, s: &Serving) -> Op {
        let (keys, me, lease) = (&self.cfg.keys, self.cfg.node_id.as_str(), self.lease);
        match &s.command {
            Command::Register { .. } => Op::Txn(records::registration(
                keys,
                me,
                self.member.as_ref(),
                (lease, self.incarnation),
                s.claiming,
            )),
            Command::Write(o) => records::write(keys, o, lease),
            Command::Withdraw { record } => {
                Op::Txn(records::withdrawal(keys, me, record, lease, s.claiming))
            }
            Command::Running { .. }
            | Command::Abandon { .. }
            | Command::Depart { .. }
            | Command::Evict { .. } => unreachable!("no single write"),
        }
    }

    fn evict_op(&self, s: &Serving) -> Op {
        let Command::Evict {
            node,
            lease,
            round,
            detect_ms,
        } = &s.command
        else {
            unreachable!("only an eviction checks a lease")
        };
        match s.stage {
            // Only while `lease` is still the one its registration lives on: the proof is
            // about the process that held it. A node that registered again (a new
            // incarnation), or a store restarted empty that handed the id to someone
            // else, is not what was found dead, and revoking it would evict a live agent.
            Stage::CheckHeld => Op::Txn(records::lease_holds(&self.cfg.keys, node, *lease)),
            Stage::SayGone => {
                let g = records::gone(*round, node, v1::Detection::Refused, *detect_ms);
                Op::Txn(records::say_gone(&self.cfg.keys, &g))
            }
            _ => Op::Revoke { lease: *lease },
        }
    }

    /// Revoking deletes our registration (and the coordinator key if we held it), so the
    /// others learn within milliseconds instead of a lease TTL. The others learn how (a
    /// leave, not a death) and status why, from records sent beside the revoke, not before
    /// it: under load one more round trip first would delay what every survivor waits for.
    fn depart_op(&self, s: &Serving) -> Op {
        let Command::Depart { how, why } = &s.command else {
            unreachable!("only a departure departs")
        };
        let gone = match (how, &self.running) {
            (Departure::Left, Some(r)) => Some(records::gone(
                r.number,
                &self.cfg.node_id,
                v1::Detection::Left,
                0,
            )),
            _ => None,
        };
        let word = self.own_word(why);
        let trim = left::trim(&self.view.left, Some(&word.tail()));
        Op::Depart {
            record: Some(records::say_left(
                &self.cfg.keys,
                &word,
                gone.as_ref(),
                &trim,
            )),
            lease: self.lease,
        }
    }

    pub(super) fn on_command_answer(
        &mut self,
        mut s: Serving,
        answer: Result<Answer, etcd_client::Error>,
    ) {
        let uses_lease = match &s.command {
            Command::Register { .. } => true,
            Command::Write(o) => o.mode == Mode::Leased,
            _ => false,
        };
        match (s.stage, answer) {
            // etcd no longer has the lease (this agent was frozen past its TTL, or etcd
            // lost it): a new one, and the write again with it, so the agent rejoins as a
            // new incarnation instead of exiting.
            (Stage::Write, Err(source)) if uses_lease && lease_not_found(&source) => {
                self.lease_gone();
                self.regrant(s, source);
            }
            (Stage::Regrant, Ok(Answer::Granted { id })) => {
                self.lease_renewed(id);
                s.stage = Stage::Write;
                self.next_op(s);
            }
            (Stage::Write, Ok(answer)) => {
                self.wrote();
                if matches!(s.command, Command::Register { .. }) {
                    self.written = Some((self.lease, self.incarnation));
                }
                let won = matches!(answer, Answer::Txn { succeeded: true });
                if matches!(s.command, Command::Register { .. }) && s.claiming && won {
                    self.elected();
                }
                self.served(s, Ok(()));
            }
            (Stage::CheckHeld, Ok(Answer::Txn { succeeded: false })) => {
                if let Command::Evict { node, lease, .. } = &s.command {
                    tracing::info!(%node, lease, "the dead agent's lease no longer holds its registration; nothing to revoke");
                }
                self.served(s, Ok(()));
            }
            (Stage::CheckHeld, Ok(_)) => {
                s.stage = Stage::SayGone;
                self.next_op(s);
            }
            (Stage::SayGone, Ok(_)) => {
                self.wrote();
                s.stage = Stage::Revoke;
                self.next_op(s);
            }
            (Stage::Revoke, r) if r.as_ref().is_ok() || r.as_ref().is_err_and(lease_not_found) => {
                if r.is_ok() {
                    self.wrote();
                }
                if let Command::Evict { node, lease, .. } = &s.command {
                    tracing::info!(%node, lease, "revoked the lease of a dead agent");
                }
                self.served(s, Ok(()));
            }
            (Stage::Depart, Ok(Answer::Departed { said, revoked })) => {
                if let Some(e) = said {
                    tracing::debug!(error = %e, "could not record the leave");
                }
                match revoked {
                    None => self.wrote(),
                    Some(e) => {
                        tracing::warn!(error = %e, "could not revoke the lease; peers will notice after its TTL")
                    }
                }
                self.served(s, Ok(()));
            }
            // The depart op itself never fails; only the driver's deadline can end it so.
            // Leaving is not retried after a re-sync: that would register the leaving node
            // again (its lease lapsed while the op hung) and could make it coordinator.
            (Stage::Depart, Err(e)) => {
                tracing::warn!(error = %e, "could not leave in words; peers will notice after its TTL");
                self.served(s, Ok(()));
            }
            (stage, Err(source)) => self.command_failed(s, stage, source),
            (_, Ok(other)) => self.unexpected(&other),
        }
    }

    /// The lease `s`'s write named was gone: the first time, a new one at once. A fresh
    /// lease that expired too before the write with it landed says the writes wait in
    /// etcd (or in this process) longer than a TTL: the next grant waits a backoff, as
    /// an overloaded answer's retry does, so that 10,000 agents regranting add no load
    /// faster than etcd drains it; past the outage bound the refusal is the answer.
    fn regrant(&mut self, mut s: Serving, source: etcd_client::Error) {
        let now = self.now;
        let since = *s.regranting_since.get_or_insert(now);
        s.regrants += 1;
        s.stage = Stage::Regrant;
        if s.regrants == 1 {
            return self.next_op(s);
        }
        if now - since > self.cfg.outage_limit {
            let what = what(&s.command, Stage::Write);
            return self.served(s, Err(RendezvousError::Etcd { what, source }));
        }
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        let delay = self.retry_delay(s.regrants - 2);
        tracing::warn!(
            leases = s.regrants - 1,
            retry_in = ?delay,
            "a new lease expired before the write with it reached etcd; granting another after a backoff"
        );
        let op = Op::Grant {
            ttl: self.cfg.ttl.as_secs().max(1) as i64,
        };
        self.retry = Some((now + delay, Then::Command(s), op));
    }

    /// A command's op failed: a transient failure keeps the command for after the next
    /// sync (never answered with it); anything else is its answer.
    fn command_failed(&mut self, s: Serving, stage: Stage, source: etcd_client::Error) {
        let what = what(&s.command, stage);
        if transient(&source) {
            tracing::warn!(error = %source, "{what} failed; retrying after reconnecting");
            self.pending.push_front((s.id, s.command));
            return self.lost(source);
        }
        self.served(s, Err(RendezvousError::Etcd { what, source }));
    }

    /// `s` is answered; what follows depends on the phase.
    fn served(&mut self, s: Serving, result: Result<(), RendezvousError>) {
        self.reply(s.id, result);
        if matches!(s.command, Command::Depart { .. }) {
            self.phase = Phase::Ended;
            return;
        }
        if let Phase::Watching { lease, .. } = self.phase {
            if self.lease != lease || self.abandon {
                self.resync_after_watching(Resync::Outage);
            } else {
                // A registration may have won the coordinator key.
                self.role_check();
            }
        }
    }
}

/// What a command was doing, for its error.
fn what(command: &Command, stage: Stage) -> &'static str {
    match (command, stage) {
        (_, Stage::Regrant) => "granting a new membership lease",
        (Command::Evict { .. }, Stage::CheckHeld) => "checking a dead agent's lease",
        (Command::Evict { .. }, Stage::SayGone) => "recording how a dead agent was found",
        (Command::Evict { .. }, _) => "revoking a dead agent's lease",
        (Command::Register { .. }, _) => <v1::Member as Record>::WRITING,
        (Command::Write(o), _) => o.writing,
        (Command::Withdraw { .. }, _) => <v1::Unhealthy as Record>::WRITING,
        (Command::Running { .. } | Command::Abandon { .. } | Command::Depart { .. }, _) => {
            "leaving the run"
        }
    }
}
