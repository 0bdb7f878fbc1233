//! The coordinator's part in a crowd's turns ([`super::turn`]): it writes how far the
//! crowd may go as one admission key at a time, leased on its own lease (a coordinator
//! gone takes its keys with it, and the next one writes them again), and times each write.
//! Information for the joining nodes only: a write that fails never holds up the
//! rendezvous (a transient failure is an outage like any other; anything else waits a
//! second and tries again).

use std::sync::atomic::Ordering;

use super::admission::place_in_crowd;
use super::fault::Fault;
use super::io::{Op, Role, Write};
use super::machine::{Machine, Phase, Then};
use super::sync::Todo;

impl Machine {
    /// As coordinator of a crowd, watching the whole run: the next admission key, if one
    /// is due.
    pub(super) fn admit(&mut self) {
        let watching = matches!(self.phase, Phase::Watching { .. });
        let coordinating =
            watching && self.role() == Role::Coordinator && !self.watches.control_only();
        let (now, formed) = (self.now, self.view.round.is_some());
        let Some(frontier) = self.frontier.as_mut() else {
            return;
        };
        if !coordinating {
            return frontier.idle();
        }
        if !frontier.ready(now) {
            return;
        }
        // Only when a key may go (ten times a second at most): a hash of each node id.
        let most = self.cfg.seal.max_nodes;
        let places: Vec<f64> = self
            .view
            .members
            .keys()
            .map(|node| place_in_crowd(node) * f64::from(most))
            .collect();
        let Some(key) = frontier.due(now, &places, formed) else {
            return;
        };
        let made = places.len();
        let op = Op::Put(Write::Put {
            key: self.cfg.keys.admission(key),
            value: made.to_string().into_bytes(),
            lease: self.lease.id(),
        });
        self.issue(Then::Todo(Todo::Admit), op);
    }

    /// The admission key was written: counted apart from this node's own writes, whose
    /// number at formation is bounded whatever the crowd, while these grow with it.
    pub(super) fn admitted(&mut self) {
        self.counters.admission_keys.fetch_add(1, Ordering::Relaxed);
        if let Some(f) = self.frontier.as_mut() {
            f.answered(self.now);
        }
        self.flight.then(Todo::Admit);
    }

    /// The admission key could not be written for `e`.
    pub(super) fn admit_failed(&mut self, e: Fault) {
        if let Some(f) = self.frontier.as_mut() {
            f.failed(self.now);
        }
        if e.transient {
            return self.lost(e);
        }
        tracing::warn!(error = %e, "could not write how far the joining crowd may go; trying again in a second");
    }
}
