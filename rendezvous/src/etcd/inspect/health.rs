//! The verdict `fsdp-agent status` gives a run ([`Health`]) and the words that say why,
//! from the view and the rows of the report.

use fsdp_proto::v1;
use serde::Serialize;

use super::report::{MemberState, RunReport};
use crate::etcd::view::View;

/// Declares [`Health`] with its names and [`Health::ALL`] from one list, so the list the
/// docs are checked against (tests/tests/doc_claims.rs) cannot miss a value.
macro_rules! health {
    ($($(#[doc = $doc:literal])* $variant:ident => $name:literal,)*) => {
        /// The verdict `fsdp-agent status` gives a run.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
        #[serde(rename_all = "snake_case")]
        pub enum Health {
            $($(#[doc = $doc])* $variant,)*
        }

        impl Health {
            /// Every value, in the order `fsdp-agent status` documents them.
            pub const ALL: &'static [Health] = &[$(Health::$variant),*];

            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $name,)*
                }
            }
        }
    };
}

health! {
    /// Every member of the round is alive and the master is published.
    Healthy => "healthy",
    /// Nodes are gathering for a round, or rank 0 has not published the master yet.
    Forming => "forming",
    /// A member of the round is gone or a worker failed: the group is re-forming.
    Degraded => "degraded",
    /// Every member of the round finished.
    Finished => "finished",
    /// No node is registered and the last round did not finish.
    Stopped => "stopped",
    /// A value in the run's keys cannot be trusted.
    Corrupt => "corrupt",
    /// A node ended the run for every node (a failure no restart mends).
    Halted => "halted",
}

/// The run's health and why, in words: untrusted keys first, then a halt, then the sealed
/// round's state; with no round, whether any node still waits for one.
pub(super) fn verdict(v: &View, r: &RunReport, round: Option<&v1::Round>) -> (Health, String) {
    if !r.corrupt.is_empty() {
        (
            Health::Corrupt,
            format!("{} untrusted key(s): {}", r.corrupt.len(), r.corrupt[0]),
        )
    } else if let Some(h) = v.halted() {
        (Health::Halted, h.to_string())
    } else if let Some(rd) = round {
        of_round(v, r, rd)
    } else {
        before_any_round(v, r)
    }
}

/// How many of the report's members are in `state`.
fn count(r: &RunReport, state: MemberState) -> usize {
    r.members.iter().filter(|m| m.state == state).count()
}

/// The health of a run with a sealed round `rd`.
fn of_round(v: &View, r: &RunReport, rd: &v1::Round) -> (Health, String) {
    let in_round = rd.members.len();
    if count(r, MemberState::Done) == in_round {
        (
            Health::Finished,
            format!("all {in_round} node(s) of round {} finished", rd.number),
        )
    } else if v.members.is_empty() {
        (
            Health::Stopped,
            "no node is registered; the run is not running".into(),
        )
    } else if v.failures.contains(&rd.number) {
        (
            Health::Degraded,
            format!("a worker failed in round {}; restarting", rd.number),
        )
    } else if count(r, MemberState::Missing) > 0 {
        let gone: Vec<_> = r
            .members
            .iter()
            .filter(|m| m.state == MemberState::Missing)
            .map(|m| m.node_id.as_str())
            .collect();
        (
            Health::Degraded,
            format!(
                "node(s) gone from round {}: {}; re-forming",
                rd.number,
                gone.join(", ")
            ),
        )
    } else if r.master.is_none() {
        (
            Health::Forming,
            format!(
                "round {} sealed; rank 0 has not published the master yet",
                rd.number
            ),
        )
    } else {
        let waiting = count(r, MemberState::Waiting);
        let extra = if waiting > 0 {
            format!("; {waiting} node(s) waiting to join")
        } else {
            String::new()
        };
        (
            Health::Healthy,
            format!(
                "{in_round} node(s), {} worker(s) running{extra}",
                r.world_size
            ),
        )
    }
}

/// The health of a run no round was sealed for: stopped when nobody waits any more,
/// else forming, with how far the registrations are from a round.
fn before_any_round(v: &View, r: &RunReport) -> (Health, String) {
    if let (true, Some(last)) = (v.members.is_empty(), r.left.last()) {
        // Nobody waits any more: the run ended before a round formed (every agent gave up
        // at its join timeout, or was stopped). "Forming" beside the left rows read as if
        // it still might.
        return (
            Health::Stopped,
            format!(
                "no round ever formed and no node is registered; the last to go was {} ({}: {})",
                last.node_id, last.reason, last.detail
            ),
        );
    }
    (
        Health::Forming,
        match r.nodes {
            Some((min, max)) if v.members.len() < min as usize => format!(
                "{} node(s) registered of the {min} needed (--nnodes {min}:{max}); waiting for {} more (each agent gives up after its join timeout)",
                v.members.len(),
                min as usize - v.members.len()
            ),
            Some((min, max)) => format!(
                "{} node(s) registered (--nnodes {min}:{max}); the coordinator seals when {max} are there or the last call after the latest arrival ends",
                v.members.len()
            ),
            None => format!(
                "{} node(s) registered; no round sealed yet",
                v.members.len()
            ),
        },
    )
}
