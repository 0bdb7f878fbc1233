//! The agent loop's side of the rendezvous, sans I/O: waiting for a round, and watching
//! the one it runs. [`Waiter`] reads the session's [`View`] and says what to do next
//! ([`Action`] while waiting, [`Watch`] while running); its drivers do it — the handle
//! (`handle.rs`, `backend.rs`) with etcd, the simulator's agent (`sim/agent.rs`) in
//! simulated time. Both drive this one copy, so a bug in the glue between the pure
//! steps ([`step`], [`detect`], [`fence::decide`]) is a bug the simulator can find.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fsdp_proto::v1;

use super::joining::{Step, detect, step};
use super::view::View;
use crate::fence::{self, FenceDecision};
use crate::{Change, RendezvousError, Round};

/// The round this node runs (or ran last: its ring neighbour stays watched into the
/// re-form, and its number says which round to ask for next).
#[derive(Debug, Clone)]
pub(crate) struct Held {
    /// Shared, so that looking at the held round (every view change: a keep-alive answer
    /// moves the lease clock) copies no member list: copies of a 1,000-member round were
    /// most of what 1,000 idle agents cost.
    pub(crate) record: Arc<v1::Round>,
    pub(crate) restart_count: u32,
    /// When this agent started waiting for the round: departures after it concern us.
    pub(crate) since: Instant,
}

/// A wait for a round in progress.
#[derive(Debug, Clone, Copy)]
struct Wait {
    wants: u64,
    since: Instant,
    /// The round whose master this node published (it is rank 0 of it).
    published: Option<u64>,
}

/// What the driver does next while waiting.
#[derive(Debug)]
pub(crate) enum Action {
    /// Nothing until the view changes.
    Wait,
    /// Ask the session to register this node for round `wants`; look again once answered.
    Register { wants: u64 },
    /// Pick a free port and write the master record of `round` (this node is its rank 0).
    PublishMaster { round: u64 },
    /// Run this round: tell the session, watch the ring neighbour, start the workers.
    Run {
        record: Arc<v1::Round>,
        round: Round,
    },
    /// A round broken before it started charged a restart the loop has not been given:
    /// hand it over, so the budget is decided as every member of that round decides it
    /// (one that ran it gives up when it is spent; this node must not wait for a round
    /// that never comes). So is a round this node was sealed into and leaves unrun (gone
    /// from view before it started, or another seal under the number it ran), as broken by
    /// its own loss. The loop asks for the next round after it.
    Charged(Round),
}

/// What the driver does while the held round runs.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Watch {
    /// Nothing until the view changes, or until `recheck` (the lease clock's next look).
    Keep { recheck: Option<Instant> },
    /// The round is over for this node.
    Over(Change),
    /// The lease may be gone: tell the session to abandon it with `abandon`, stop
    /// watching the neighbour (cut off, this node proves nothing about anyone), and stop.
    Fence { abandon: String, change: Change },
}

/// What a look hands the loop beside the round this node was sealed into and leaves
/// unrun ([`sealed_first`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Beside {
    /// Nothing: it waits for the next round.
    Nothing,
    /// A round to run, which charged this many restarts.
    Runs(u32),
    /// A round it was in that broke before it started, which charged this many.
    Broken(u32),
}

/// Whether the round this node was sealed into and leaves unrun, which charged `sealed`
/// restarts, goes to the loop before what the look hands over `beside` it. Its other
/// members decided the budget by it, so this node does too, and first, unless what goes
/// beside it tells as much: a round to run tells its own count (a tie runs, one check of
/// the budget); a broken round that charged more goes first, and of two that charged as
/// much the sealed one (the lower count first would be a second hand-over later, two
/// checks of the budget for one round).
fn sealed_first(sealed: u32, beside: Beside) -> bool {
    match beside {
        Beside::Nothing => true,
        Beside::Runs(count) => sealed > count,
        Beside::Broken(count) => sealed >= count,
    }
}

/// The agent loop's rendezvous state.
#[derive(Debug, Clone)]
pub(crate) struct Waiter {
    me: String,
    my_workers: u32,
    max_nodes: u32,
    /// How long before the lease could expire this node stops its workers.
    margin: Duration,
    held: Option<Held>,
    waiting: Option<Wait>,
    /// The highest restart count of a round handed to the loop (run or charged).
    restarts_told: u32,
    /// The newest round naming this node that it saw while waiting for it or running
    /// another (one it then ran is no matter: its count was told). It charged its restart count to this node as to its
    /// other members, who give up when it spent the budget; this node must too, even when
    /// it never looks at that round again: its lease ran out before the round started and
    /// the next look shows only the round sealed without it (seed 207789), or it was
    /// another seal under the number of the round it ran (seed 209829).
    sealed_in: Option<Arc<v1::Round>>,
    /// The round whose start waits for etcd's word on the lease (said once).
    doubted: Option<u64>,
}

impl Waiter {
    pub(crate) fn new(me: String, my_workers: u32, max_nodes: u32, margin: Duration) -> Self {
        Self {
            me,
            my_workers,
            max_nodes,
            margin,
            held: None,
            waiting: None,
            restarts_told: 0,
            sealed_in: None,
            doubted: None,
        }
    }

    pub(crate) fn held(&self) -> Option<&Held> {
        self.held.as_ref()
    }

    /// The round waited for, and since when; `None` while running.
    pub(crate) fn waiting_for(&self) -> Option<(u64, Instant)> {
        self.waiting.map(|w| (w.wants, w.since))
    }

    /// Begins waiting for the next round: the one after the round this node ran, or
    /// after the newest it sees when it ran none. A round before it that this node was
    /// sealed into and did not run is handed over first.
    pub(crate) fn begin(&mut self, v: &View, now: Instant) -> Action {
        let wants = match &self.held {
            Some(h) => h.record.number + 1,
            None => v.round.as_ref().map_or(0, |r| r.record.number + 1),
        };
        self.note_sealed_in(v, wants);
        if let Some(round) = self.sealed_handed_first(Beside::Nothing, Some(wants)) {
            self.waiting = None;
            return Action::Charged(round);
        }
        self.waiting = Some(Wait {
            wants,
            since: now,
            published: None,
        });
        Action::Register { wants }
    }

    /// One look at the view while waiting.
    pub(crate) fn on_view(&mut self, v: &View, now: Instant) -> Result<Action, RendezvousError> {
        let Some(w) = self.waiting else {
            return Ok(Action::Wait);
        };
        self.note_sealed_in(v, w.wants);
        let next = step(v, &self.me, self.my_workers, w.wants, w.published, w.since)?;
        Ok(match next {
            Step::Wait => Action::Wait,
            Step::Done(done) => {
                let (record, round) = *done;
                if self.lease_in_doubt(v, now, record.number) {
                    // Not started (workers could run under a lease etcd let expire, beside
                    // a group that re-forms without them), and not given up either: the
                    // session asks etcd, whose word wakes this look again (`published.rs`),
                    // and the round starts once etcd says the lease stands, or is joined
                    // again once etcd says it is gone (why: docs/rendezvous.md, "Start").
                    return Ok(Action::Wait);
                }
                if self.doubted.take() == Some(record.number) {
                    tracing::info!(
                        round = record.number,
                        "etcd says the lease stands; starting the round"
                    );
                }
                // A round this node was sealed into may have charged restarts this one
                // does not carry: etcd lost them with its data before anyone put that
                // round back (a member of a placed round holds too little of it to). Its
                // number says nothing here: etcd counts rounds again from what it kept, so
                // the round that lost the charges may be numbered below the one that made
                // them (seed 1456934009). Within one life of etcd counts never go down,
                // but a view can (a resync's serializable read from a member behind): a
                // newer round handed over then is one this node was sealed into, with its
                // own count, so it gives up only where that round's members do, and
                // otherwise asks for the next round as before.
                let runs = Beside::Runs(record.restart_count);
                if let Some(charged) = self.sealed_handed_first(runs, None) {
                    self.waiting = None;
                    return Ok(Action::Charged(charged));
                }
                self.restarts_told = self.restarts_told.max(round.restart_count);
                self.held = Some(Held {
                    record: record.clone(),
                    restart_count: round.restart_count,
                    since: w.since,
                });
                self.waiting = None;
                Action::Run { record, round }
            }
            Step::PublishMaster { round } => {
                self.waiting = Some(Wait {
                    published: Some(round),
                    ..w
                });
                Action::PublishMaster { round }
            }
            Step::Broken { next, change } => {
                tracing::info!(
                    round = next - 1,
                    %change,
                    "the round broke before it started; waiting for the next"
                );
                // Or one it was sealed into and will never run, by the rule of
                // [`sealed_first`] (another seal under the broken round's number may carry
                // fewer charges: etcd came back empty and a new process sealed it from
                // nothing, seed 2482646557).
                let broken = v.round.as_ref().map(|r| &r.record);
                let broken = broken.filter(|r| r.number == next - 1);
                let beside = broken.map_or(Beside::Nothing, |b| Beside::Broken(b.restart_count));
                let charged = self
                    .sealed_handed_first(beside, Some(next))
                    .or_else(|| self.charged_in_broken(v, next - 1, change))
                    .or_else(|| self.sealed_handed_first(Beside::Nothing, Some(next)));
                if let Some(round) = charged {
                    self.waiting = None;
                    return Ok(Action::Charged(round));
                }
                self.register_for(next)
            }
            Step::Spare { next, members } => {
                self.log_spare(next - 1, members);
                if let Some(round) = self.sealed_handed_first(Beside::Nothing, Some(next)) {
                    self.waiting = None;
                    return Ok(Action::Charged(round));
                }
                self.register_for(next)
            }
        })
    }

    /// One look at the view while the held round runs.
    pub(crate) fn on_running_view(
        &mut self,
        v: &View,
        now: Instant,
    ) -> Result<Watch, RendezvousError> {
        let Some(number) = self.held.as_ref().map(|h| h.record.number) else {
            return Ok(Watch::Keep { recheck: None });
        };
        if let Some(c) = v.corruption() {
            return Err(RendezvousError::Corrupt(c));
        }
        // A later round that names this node, or another seal under the held number.
        self.note_sealed_in(v, number);
        let Some(held) = &self.held else {
            return Ok(Watch::Keep { recheck: None });
        };
        if let Some(change) = detect(v, &held.record, &self.me, held.since) {
            return Ok(Watch::Over(change));
        }
        if crate::switches::NEVER_FENCE.with(std::cell::Cell::get) {
            return Ok(Watch::Keep { recheck: None });
        }
        Ok(match fence::decide(now, v.lease_safe_until, self.margin) {
            FenceDecision::Fence { reason, left } => Watch::Fence {
                abandon: format!(
                    "stopped its workers in round {}: {reason}",
                    held.record.number
                ),
                change: Change::Fenced {
                    reason,
                    stop_within: left,
                },
            },
            FenceDecision::Hold { recheck_at } => Watch::Keep {
                recheck: Some(recheck_at),
            },
            FenceDecision::Unknown => Watch::Keep { recheck: None },
        })
    }

    /// Waits for round `wants` from here on.
    fn register_for(&mut self, wants: u64) -> Action {
        if let Some(w) = &mut self.waiting {
            w.wants = wants;
        }
        Action::Register { wants }
    }

    /// Round `number`, broken before it started, if it charged the job a restart this
    /// node's loop has not been given yet.
    fn charged_in_broken(&mut self, v: &View, number: u64, change: Change) -> Option<Round> {
        let rec = Arc::clone(&v.round.as_ref()?.record);
        if rec.number != number {
            return None;
        }
        self.charged_in(&rec, change)
    }

    /// Round `rec`, which names this node and broke with `change` before it started, if
    /// it charged the job a restart this node's loop has not been given yet.
    fn charged_in(&mut self, rec: &v1::Round, change: Change) -> Option<Round> {
        if crate::switches::NO_CHARGE_IN_BROKEN.with(std::cell::Cell::get) {
            return None;
        }
        if rec.restart_count <= self.restarts_told {
            return None;
        }
        let round = super::joining::broken_round(rec, &self.me, change)?;
        self.restarts_told = rec.restart_count;
        Some(round)
    }

    /// The round this node was sealed into and did not run ([`Self::sealed_in`]), if
    /// [`sealed_first`] hands it over before `beside`, it charged a restart the loop has
    /// not been given (broken by this node's loss, as its other members see it), and,
    /// given `before`, it is numbered below that: the round this node is about to ask
    /// for, which it will never run then (it is forgotten there, charged or not).
    fn sealed_handed_first(&mut self, beside: Beside, before: Option<u64>) -> Option<Round> {
        let count = self.sealed_in.as_ref()?.restart_count;
        if !sealed_first(count, beside) {
            return None;
        }
        let rec = match before {
            Some(next) => self.sealed_in.take_if(|r| r.number < next)?,
            None => Arc::clone(self.sealed_in.as_ref()?),
        };
        self.charged_as_lost(&rec)
    }

    /// Round `rec`, which this node was sealed into and did not run, if it charged a
    /// restart its loop has not been given: broken by this node's loss, as its other
    /// members see it.
    fn charged_as_lost(&mut self, rec: &v1::Round) -> Option<Round> {
        let me = Change::MemberLost {
            node: self.me.clone(),
        };
        let round = self.charged_in(rec, me)?;
        tracing::info!(
            round = round.number,
            restart_count = round.restart_count,
            "a round this node was sealed into went on without it; handing over its restart count"
        );
        Some(round)
    }

    /// Remembers the view's round if it names this node, is numbered `from` or later (the
    /// round waited for; the held one's number while running) and is not the round held.
    /// Looked at on every change of the view: the members are scanned only for a round
    /// neither remembered nor held (a keep-alive answer shows the held one again and
    /// again).
    fn note_sealed_in(&mut self, v: &View, from: u64) {
        let Some(rec) = v.round.as_ref().map(|r| &r.record) else {
            return;
        };
        let same = |r: Option<&Arc<v1::Round>>| r.is_some_and(|r| Arc::ptr_eq(r, rec));
        if rec.number < from
            || same(self.sealed_in.as_ref())
            || same(self.held.as_ref().map(|h| &h.record))
        {
            return;
        }
        // A round that carries fewer charges (etcd lost them with its data: a later
        // round, another seal under the same number, or one numbered below, counted
        // again from what etcd kept) does not make this node forget the round that
        // charged them.
        let forgets_charges = self
            .sealed_in
            .as_ref()
            .is_some_and(|s| s.restart_count > rec.restart_count);
        if !forgets_charges && rec.members.iter().any(|m| m.node_id == self.me) {
            self.sealed_in = Some(Arc::clone(rec));
        }
    }

    /// Whether workers started now could run under a lease etcd may have expired (said
    /// once per round).
    fn lease_in_doubt(&mut self, v: &View, now: Instant, round: u64) -> bool {
        if crate::switches::NEVER_FENCE.with(std::cell::Cell::get) {
            return false;
        }
        if !fence::in_doubt(now, v.lease_safe_until, self.margin) {
            return false;
        }
        if self.doubted != Some(round) {
            self.doubted = Some(round);
            if let FenceDecision::Fence { reason, .. } =
                fence::decide(now, v.lease_safe_until, self.margin)
            {
                tracing::warn!(round, %reason, "not starting the round until etcd says the lease stands");
            }
        }
        true
    }

    /// Says why this node is not in `round`, from that round's own size (the view may
    /// already hold a newer round: its size would tell another story).
    fn log_spare(&self, round: u64, members: usize) {
        if members >= self.max_nodes as usize {
            tracing::info!(
                round,
                members,
                max = self.max_nodes,
                "the group is full; waiting as a spare"
            );
        } else {
            // Sealed before this node registered: the coordinator grows the group with it
            // next.
            tracing::info!(
                round,
                members,
                max = self.max_nodes,
                "the round was sealed without this node; joining the next"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Beside, sealed_first};

    /// The one rule for a round this node was sealed into and leaves unrun: first when
    /// nothing else goes, before a round to run only if it charged more, before a broken
    /// round if it charged as much or more.
    #[test]
    fn a_round_sealed_in_and_left_unrun_goes_first_unless_what_goes_beside_tells_as_much() {
        for (sealed, beside, first) in [
            (0, Beside::Nothing, true),
            (3, Beside::Nothing, true),
            (3, Beside::Runs(2), true),
            (3, Beside::Runs(3), false),
            (3, Beside::Runs(4), false),
            (3, Beside::Broken(2), true),
            (3, Beside::Broken(3), true),
            (3, Beside::Broken(4), false),
        ] {
            assert_eq!(
                sealed_first(sealed, beside),
                first,
                "{sealed} beside {beside:?}"
            );
        }
    }
}
