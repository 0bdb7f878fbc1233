//! The coordinator's bookkeeping around [`seal::decide`]: the clocks and the memory that
//! turn a stream of [`View`]s into the [`SealState`] the rule needs. No I/O: the session
//! calls [`Coordinator::observe`] on every change and at the instant it asked to be called
//! back; the tests call it with hand-built views and chosen clocks.

use std::collections::{BTreeSet, HashSet};
use std::time::{Duration, Instant};

use fsdp_proto::{SCHEMA_VERSION, v1};

use super::view::View;
use crate::pace::{Basis, HoldRule, Pace, PaceConfig, PaceDecision};
use crate::seal::{self, Candidate, Current, Proposal, SealConfig, SealDecision, SealState};

/// What the coordinator remembers between observations.
#[derive(Debug, Clone)]
pub struct Coordinator {
    cfg: SealConfig,
    /// When the set of registered nodes last changed: the last call runs from here.
    quiet_since: Instant,
    /// The registered nodes at the last observation.
    member_ids: BTreeSet<String>,
    /// The round found in need of re-forming, and when: the straggler timeout runs from
    /// here, once per round, however often the coordinator looks.
    reform: Option<(u64, Instant)>,
    /// The shape of the last reason logged ([`shape`]), and when it was logged.
    last_logged: Option<(String, Instant)>,
    /// The rounds sealed so far, against a loop ([`crate::pace`]).
    pace: Pace,
    /// What the last proposal rests on, for [`Coordinator::sealed`].
    proposed: Option<Proposed>,
    /// The end of the hold last reported: one error line per hold, not per look.
    held_until: Option<Instant>,
}

/// What a proposal rests on, and whether it only drops members of the current round (not
/// paced, and no strike in a churn episode: [`Pace::dropped`]).
#[derive(Debug, Clone, Copy)]
struct Proposed {
    basis: Basis,
    drops: bool,
}

/// How often a reason of an unchanged shape is logged again (progress while nodes gather).
pub const RELOG_EVERY: Duration = Duration::from_secs(10);

/// A reason without its numbers: "7 of max 1000 nodes present; last call ends in 1.2s"
/// and "8 of max 1000 ..." are one state of the rendezvous, not two. Logging every count
/// made 1,952 lines (8.7 MB) while 1,000 nodes registered; by shape it is a handful.
fn shape(reason: &str) -> String {
    reason
        .chars()
        .filter(|c| !c.is_ascii_digit() && *c != '.')
        .collect()
}

/// One observation's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observation {
    pub decision: SealDecision,
    pub reason: String,
    /// Worth a log line: the reason's shape changed, or [`RELOG_EVERY`] passed since the
    /// last line.
    pub new_reason: bool,
    /// The mod revision of the round a commit replaces (`None`: there is none).
    pub fence: Option<i64>,
    /// The rule said seal, but rounds came too fast: why the round waits and which rule
    /// holds it ([`crate::pace`]), when this hold is new (worth a log line).
    pub held: Option<(String, HoldRule)>,
}

impl Coordinator {
    pub fn new(cfg: SealConfig, now: Instant) -> Self {
        Self {
            cfg,
            quiet_since: now,
            member_ids: BTreeSet::new(),
            reform: None,
            last_logged: None,
            pace: Pace::new(PaceConfig::default()),
            proposed: None,
            held_until: None,
        }
    }

    /// The proposal of the last observation was committed as round `number` at `now`.
    pub fn sealed(&mut self, now: Instant, number: u64, reason: &str) {
        match self.proposed.take() {
            Some(p) if p.drops => self.pace.dropped(now, number, p.basis, reason),
            Some(p) => self.pace.sealed(now, number, p.basis, reason),
            None => {}
        }
    }

    /// Updates the clocks from `v` as seen at `now` and asks [`seal::decide`] what to do.
    pub fn observe(&mut self, now: Instant, v: &View) -> Observation {
        if let Some(waiting) = self.below_minimum(now, v) {
            return waiting;
        }
        self.note_members(now, v);
        let current = current(v);
        let candidates = candidates(v, current.as_ref());
        self.forget_older_reform(current.as_ref());
        let state = SealState {
            current: current.as_ref(),
            candidates: &candidates,
            quiet_since: self.quiet_since,
            reform_since: self.reform.map(|(_, t)| t),
        };
        let (mut decision, reason) = seal::decide(now, &state, &self.cfg);
        if let SealDecision::Seal(p) = &mut decision {
            p.number = first_number_all_wait_for(p, v);
        }
        let held = self.pace(now, v, current.as_ref(), &mut decision);
        self.start_reform(now, current.as_ref(), &decision);
        self.observation(now, v, decision, reason, held)
    }

    /// The observation of a view with no round and fewer registrations than the minimum,
    /// where nothing can be sealed; `None` for any other view.
    ///
    /// The full look of [`Coordinator::observe`] copies every registration's id: at each
    /// of the N registrations of a formation that made the coordinator's CPU O(N²) (234 ms
    /// at 2,000 nodes in rdzv-bench). What [`seal::decide`] says here is known without it.
    fn below_minimum(&mut self, now: Instant, v: &View) -> Option<Observation> {
        let min = self.cfg.min_nodes as usize;
        if v.round.is_some() || v.members.len() >= min {
            return None;
        }
        // Whatever woke this look, the ids are taken afresh at the first full one, which a
        // registration brings (only one makes the minimum): its clock starts there, as it
        // would have.
        self.member_ids.clear();
        self.proposed = None;
        let reason = format!(
            "waiting for nodes: {} of min {min} present",
            v.members.len()
        );
        Some(self.observation(
            now,
            v,
            SealDecision::Wait { recheck_at: None },
            reason,
            None,
        ))
    }

    /// The registered nodes of `v`: when they changed, the last call starts again at `now`.
    fn note_members(&mut self, now: Instant, v: &View) {
        let ids: BTreeSet<String> = v.members.keys().cloned().collect();
        if ids != self.member_ids {
            self.member_ids = ids;
            self.quiet_since = now;
        }
    }

    /// A re-form clock belongs to one round: a newer round starts without one.
    fn forget_older_reform(&mut self, current: Option<&Current>) {
        if let Some(c) = current {
            if self.reform.is_none_or(|(n, _)| n != c.number) {
                self.reform = None;
            }
        }
    }

    /// Holds a seal in `decision` back when rounds come too fast ([`crate::pace`]), and
    /// remembers what a seal that goes rests on. Returns why a hold that is new holds.
    fn pace(
        &mut self,
        now: Instant,
        v: &View,
        current: Option<&Current>,
        decision: &mut SealDecision,
    ) -> Option<(String, HoldRule)> {
        self.proposed = None;
        let SealDecision::Seal(p) = &*decision else {
            return None;
        };
        let basis = basis(v);
        // A round that only drops members is no loop: there are only so many to drop.
        // Held, a job torn down node by node (every pod deleted at once) logged "sealed
        // too fast" at each of its ends.
        let drops = only_drops(p, current);
        let pace = if drops {
            PaceDecision::Go
        } else {
            self.pace.check(now, basis)
        };
        match pace {
            PaceDecision::Go => {
                self.proposed = Some(Proposed { basis, drops });
                None
            }
            PaceDecision::Hold { until, why, rule } => {
                *decision = SealDecision::Reforming {
                    recheck_at: Some(until),
                };
                if self.held_until == Some(until) {
                    return None;
                }
                self.held_until = Some(until);
                Some((why, rule))
            }
        }
    }

    /// A decision that breaks the current round starts its re-form clock, once per round.
    fn start_reform(&mut self, now: Instant, current: Option<&Current>, decision: &SealDecision) {
        let breaking = matches!(
            decision,
            SealDecision::Reforming { .. } | SealDecision::Seal(_)
        );
        if let Some(c) = current.filter(|_| breaking && self.reform.is_none()) {
            self.reform = Some((c.number, now));
        }
    }

    /// `decision`, for `reason`, as an [`Observation`]: whether the reason is worth a
    /// log line, and the fence a commit would need.
    fn observation(
        &mut self,
        now: Instant,
        v: &View,
        decision: SealDecision,
        reason: String,
        held: Option<(String, HoldRule)>,
    ) -> Observation {
        let shaped = shape(&reason);
        let new_reason = self.last_logged.as_ref().is_none_or(|(last, at)| {
            *last != shaped || now.saturating_duration_since(*at) >= RELOG_EVERY
        });
        if new_reason {
            self.last_logged = Some((shaped, now));
        }
        Observation {
            decision,
            reason,
            new_reason,
            fence: v.round_fence(),
            held,
        }
    }
}

/// The round `v` holds, as the seal rule sees it.
fn current(v: &View) -> Option<Current> {
    v.round.as_ref().map(|r| Current {
        number: r.record.number,
        members: r.record.members.iter().map(|m| m.node_id.clone()).collect(),
        restart_count: r.record.restart_count,
        failed: v.failures.contains(&r.record.number),
        finished: v.done.get(&r.record.number).cloned().unwrap_or_default(),
        departed: r.record.members.iter().any(|m| {
            v.departed
                .get(&m.node_id)
                .is_some_and(|d| d.incarnation >= m.incarnation)
        }),
    })
}

/// The registered nodes of `v`, each ready once it asks for a round after `current`.
fn candidates(v: &View, current: Option<&Current>) -> Vec<Candidate> {
    v.members
        .values()
        .map(|m| Candidate {
            node_id: m.record.node_id.clone(),
            joined_rev: m.create_rev,
            ready: current.is_none_or(|c| m.record.wants_round > c.number),
            segment: m.record.segment.clone(),
        })
        .collect()
}

/// Whether `p` keeps some of `current`'s members and adds nobody: a group shrinking.
fn only_drops(p: &Proposal, current: Option<&Current>) -> bool {
    let Some(c) = current else {
        return false;
    };
    let before: HashSet<&str> = c.members.iter().map(String::as_str).collect();
    p.members.len() < c.members.len()
        && p.restart_count == c.restart_count
        && p.members.iter().all(|m| before.contains(m.as_str()))
}

/// What a seal in view `v` rests on: every registration (node, incarnation, create
/// revision) and every failure reported.
fn basis(v: &View) -> Basis {
    Basis::of(
        v.members
            .iter()
            .map(|(id, m)| (id.as_str(), m.record.incarnation, m.create_rev)),
        v.failures.iter().copied(),
    )
}

/// The first number every member of `p` waits for: a member registered for a later round
/// than the next (it knew rounds that etcd lost with its data) would otherwise wait out one
/// re-form per number in between.
fn first_number_all_wait_for(p: &seal::Proposal, v: &View) -> u64 {
    let wanted = p.members.iter().filter_map(|id| v.members.get(id));
    wanted
        .map(|m| m.record.wants_round)
        .fold(p.number, u64::max)
}

/// The round record to commit for `p` at `now_ms` (Unix ms): the members' own
/// registrations, in the proposal's order (every proposed member is registered: proposals
/// are made from registrations), and the charges carried over, plus one at `now_ms` when
/// `p` charges a failure. `since_previous`: how long ago the round it replaces was sealed,
/// as this coordinator measures it; the charges' ages grow by it.
pub fn round_record(
    p: &Proposal,
    v: &View,
    reason: &str,
    now_ms: u64,
    since_previous: std::time::Duration,
) -> v1::Round {
    let previous = v.round.as_ref().map(|r| &r.record);
    let mut charged_at_ms = previous
        .map(|r| r.charged_at_ms.clone())
        .unwrap_or_default();
    let passed = u64::try_from(since_previous.as_millis()).unwrap_or(u64::MAX);
    let mut charged_ago_ms: Vec<u64> = previous
        .map(|r| ages(r).map(|a| a.saturating_add(passed)).collect())
        .unwrap_or_default();
    if p.restart_count > previous.map_or(0, |r| r.restart_count) {
        charged_at_ms.push(now_ms);
        charged_ago_ms.push(0);
    }
    let extra = charged_at_ms.len().saturating_sub(crate::CHARGES_KEPT);
    charged_at_ms.drain(..extra);
    let extra = charged_ago_ms.len().saturating_sub(crate::CHARGES_KEPT);
    charged_ago_ms.drain(..extra);
    v1::Round {
        charged_at_ms,
        charged_ago_ms,
        sealed_at_ms: now_ms,
        schema: SCHEMA_VERSION,
        number: p.number,
        members: p
            .members
            .iter()
            .filter_map(|id| v.members.get(id).map(|m| m.record.clone()))
            // What round a member last asked for says nothing once it is in this one, and
            // a survivor that asked again must not make the round's delta name it. What
            // it was told of the group and its budget is for `fsdp-agent status`, which
            // reads it from the registrations: a round is sent to every member, and at
            // 10,000 nodes each byte a member costs there is 100 MB of watch traffic.
            .map(|mut m| {
                // A copy of the registration's fields (it is shared with the view).
                let fields = &mut *m;
                fields.wants_round = 0;
                fields.min_nodes = 0;
                fields.max_nodes = 0;
                fields.max_restarts = None;
                fields.restart_window_s = 0;
                // Said once for the round (`Round.job`).
                fields.job = String::new();
                // Its place is its rank now; a coordinator orders the next round from the
                // registrations.
                fields.segment = String::new();
                m
            })
            .collect(),
        restart_count: p.restart_count,
        reason: reason.to_owned(),
        dropped: previous.map(|r| dropped(r, p)).unwrap_or_default(),
        ..v1::Round::default()
    }
}

/// The members of `previous` that `p` does not keep ([`v1::Round::dropped`]).
fn dropped(previous: &v1::Round, p: &Proposal) -> Vec<String> {
    let kept: std::collections::HashSet<&str> = p.members.iter().map(String::as_str).collect();
    previous
        .members
        .iter()
        .filter(|m| !kept.contains(m.node_id.as_str()))
        .map(|m| m.node_id.clone())
        .collect()
}

/// The ages of `round`'s charges at its seal ([`v1::Round::charged_ago_ms`]); for a round
/// of an older agent, which has none, its wall-clock times taken against its own seal.
pub fn ages(round: &v1::Round) -> impl Iterator<Item = u64> + '_ {
    let from_clock = round.charged_ago_ms.is_empty().then(|| {
        round
            .charged_at_ms
            .iter()
            .map(|t| round.sealed_at_ms.saturating_sub(*t))
    });
    round
        .charged_ago_ms
        .iter()
        .copied()
        .chain(from_clock.into_iter().flatten())
}

#[cfg(test)]
mod tests;
