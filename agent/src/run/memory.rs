//! What the loop remembers across phases, as types: a round is named with its members
//! (a later round is compared with it), and everything a later decision reads lives in
//! one [`Memory`] that only the pure handler ([`super::decide`]) changes.

use std::sync::Arc;

use fsdp_rendezvous::{Round, RoundMember};

use crate::failure::{Failure, WorkerExit};
use crate::policy::{FailedRound, ProgressLedger};

/// A round by its number, with the nodes that were in it (the round's own list, shared).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundMembers {
    pub number: u64,
    pub members: Arc<[RoundMember]>,
}

impl RoundMembers {
    pub fn of(round: &Round) -> Self {
        Self {
            number: round.number,
            members: round.members.clone(),
        }
    }

    /// The members' node ids, in rank order.
    pub fn ids(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| m.node_id().to_owned())
            .collect()
    }

    /// The members of this round that `next` lacks.
    pub fn missing_from<'a>(&'a self, next: &'a Round) -> impl Iterator<Item = &'a str> {
        missing(&self.members, &next.members)
    }
}

/// The node ids of `before` that `after` lacks.
pub fn missing<'a>(
    before: &'a [RoundMember],
    after: &'a [RoundMember],
) -> impl Iterator<Item = &'a str> {
    fsdp_rendezvous::lacking::lacking(before, after, RoundMember::node_id).into_iter()
}

/// The loop's state that outlives a phase.
#[derive(Debug, Default)]
pub struct Memory {
    /// This node's last worker failure: its code is the exit code if the budget runs out.
    pub last_failure: Option<WorkerExit>,
    /// The job-wide restart count of the last round started: a higher one is a restart.
    pub last_restart_count: u32,
    /// The last round this node ran: whoever of it the next round lacks was lost, and how
    /// that was noticed is reported once the next round forms (by then every agent has the
    /// record), whatever change woke this node first (a peer's death often reaches the
    /// survivors' workers, as a failure, before its eviction).
    pub last_round: Option<RoundMembers>,
    /// The round this node found hung: the culprit is named once every node had the
    /// chance to say where its ranks were.
    pub declared_hang: Option<RoundMembers>,
    /// How far the ranks got over the run's failed attempts (the no-progress rule).
    pub ledger: ProgressLedger,
    /// The last round, if it ended in a failure (quarantine judges it once the next round
    /// forms).
    pub failed: Option<RoundMembers>,
    /// The latest failed rounds, oldest first.
    pub failed_rounds: Vec<FailedRound>,
    /// The first failure of this node's last failed group: the root cause when the job
    /// ends on it.
    pub root_cause: Option<Failure>,
}
