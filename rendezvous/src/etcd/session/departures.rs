//! The records of departures the session writes ([`crate::etcd::left`]): this node's word
//! when it fences itself, and, as coordinator, the word for members lost without one and
//! the trim of the oldest records. Each is information for status only: an error writing
//! one never holds up the rendezvous (a transient one is retried after the next sync like
//! any other; anything else drops the word).

use std::collections::BTreeSet;

use fsdp_proto::v1;

use super::fault::Fault;
use super::io::{Op, Role};
use super::machine::{Machine, Then};
use super::records;
use super::sync::Todo;
use crate::LeftReason;
use crate::etcd::left::{self, KEPT, Word};
use crate::etcd::record::Record;
use crate::etcd::view::LeftEntry;

/// The coordinator's part in the departure records.
#[derive(Debug, Default)]
pub(super) struct Sayer {
    /// The departures of round members it recorded or found explained.
    dealt: BTreeSet<left::Departure>,
    /// The write in flight.
    saying: Option<Saying>,
}

/// The coordinator's write in flight: the departure it says "lost" for, and the records
/// it deletes.
#[derive(Debug, Default)]
struct Saying {
    lost: Option<v1::Left>,
    trimmed: Vec<String>,
}

impl Machine {
    /// This node's record of leaving for `why`, as its registration stands now.
    pub(super) fn own_word(&self, why: &LeftReason) -> v1::Left {
        let round = self
            .me
            .running()
            .map(|r| r.number)
            .or_else(|| self.view.round.as_ref().map(|r| r.record.number))
            .unwrap_or(0);
        Word {
            node_id: &self.cfg.node_id,
            incarnation: self.lease.incarnation(),
            addr: &self.cfg.addr,
            round,
            at_ms: self.unix_ms(),
            by: &self.cfg.node_id,
        }
        .record(why)
    }

    /// Before a fenced lease is revoked: why, so that the others do not call it lost.
    pub(super) fn say_fenced(&mut self) {
        let Some(word) = self.me.fenced_word() else {
            return;
        };
        let trim = left::trim(&self.view.left, Some(&word.tail()));
        let round = self.view.round.as_ref();
        let since = round
            .filter(|r| r.record.number == word.round)
            .map(|r| r.mod_rev);
        let txn = records::say_left(&self.cfg.keys, word, None, &trim, since);
        self.issue(Then::Todo(Todo::SayFenced), Op::Txn(txn));
    }

    /// As coordinator, outside an outage's grace: the next member of the round gone
    /// without a word gets one ("lost"), or the oldest records beyond those kept go.
    pub(super) fn say_lost(&mut self) {
        let grace = self.watches.grace_until().is_some();
        if self.role() != Role::Coordinator || grace || self.watches.control_only() {
            return;
        }
        self.forget_dealt();
        let gone = left::vanished(&self.view, &self.cfg.node_id, &self.sayer.dealt);
        let breakers = match (gone.is_empty(), self.view.round.as_ref()) {
            (false, Some(r)) => left::breakers(&self.view, r),
            _ => Vec::new(),
        };
        let mut unsaid = None;
        for g in gone {
            // A member of a round its members know broke: no news to them.
            if g.explained || breakers.iter().any(|b| *b != g.node_id) {
                self.sayer.dealt.insert((g.node_id, g.incarnation));
            } else if unsaid.is_none() {
                unsaid = Some(g);
            }
        }
        let me = self.cfg.node_id.clone();
        let (saying, txn) = match unsaid {
            Some(g) => {
                let why = left::lost_reason(&self.view, &g);
                let word = Word {
                    node_id: &g.node_id,
                    incarnation: g.incarnation,
                    addr: &g.addr,
                    round: g.round,
                    at_ms: self.unix_ms(),
                    by: &me,
                }
                .record(&why);
                let trim = left::trim(&self.view.left, Some(&word.tail()));
                tracing::info!(node = %g.node_id, detail = %why.detail, "a member left without a word; recording it as lost");
                let txn = records::say_lost(&self.cfg.keys, &word, &trim);
                (
                    Saying {
                        lost: Some(word),
                        trimmed: trim,
                    },
                    txn,
                )
            }
            None if self.view.left.len() > KEPT => {
                let trim = left::trim(&self.view.left, None);
                (
                    Saying {
                        lost: None,
                        trimmed: trim.clone(),
                    },
                    records::trim_left(&self.cfg.keys, &trim),
                )
            }
            None => return,
        };
        self.sayer.saying = Some(saying);
        self.issue(Then::Todo(Todo::SayLost), Op::Txn(txn));
    }

    /// The coordinator's write went through (`written`: its word was stored, not the
    /// node's own, which stood already): that departure is dealt with, the trimmed records
    /// are gone from the view (their deletes come later), and the next is looked at.
    pub(super) fn said_lost(&mut self, written: bool) {
        self.wrote();
        if let Some(s) = self.sayer.saying.take() {
            let v = self.view.edit();
            for t in &s.trimmed {
                v.left.remove(t);
            }
            if let Some(word) = s.lost {
                self.sayer
                    .dealt
                    .insert((word.node_id.clone(), word.incarnation));
                // In the view at once, as the members will hold it: it breaks the round
                // for them ([`left::breakers`]) before it comes back on the watch with
                // its revision (later than the round's; none is known yet). A put the
                // watch brought first is etcd's, and stays.
                if written {
                    let entry = LeftEntry {
                        record: word,
                        mod_rev: i64::MAX,
                    };
                    v.left.entry(entry.record.tail()).or_insert(entry);
                }
            }
        }
        self.flight.first(Todo::SayLost);
    }

    /// A departure record could not be written for `e`: transient, it is retried after
    /// the next sync; anything else drops it (it is information, never worth a stuck
    /// rendezvous).
    pub(super) fn word_failed(&mut self, todo: Todo, e: Fault) {
        if e.transient {
            self.sayer.saying = None;
            return self.lost(e);
        }
        tracing::warn!(error = %e, "could not record why a node left; going on without it");
        match todo {
            Todo::SayFenced => self.me.word_done(),
            _ => {
                if let Some(word) = self.sayer.saying.take().and_then(|s| s.lost) {
                    self.sayer.dealt.insert((word.node_id, word.incarnation));
                }
            }
        }
    }

    /// Departures of members no longer in the round are never looked at again.
    fn forget_dealt(&mut self) {
        let Some(r) = self.view.round.as_ref() else {
            return;
        };
        let named: BTreeSet<(&str, u64)> = r
            .record
            .members
            .iter()
            .map(|m| (m.node_id.as_str(), m.incarnation))
            .collect();
        self.sayer
            .dealt
            .retain(|(n, i)| named.contains(&(n.as_str(), *i)));
    }
}
