//! This node's place in the run: the registration it writes whenever the lease is new,
//! whether etcd holds it as written, the round it runs (and the newest it saw, to put
//! back if etcd loses it), and its word and lease to give up after it fenced itself.

use std::sync::Arc;

use fsdp_proto::v1;

#[derive(Debug, Default)]
pub(super) struct Registration {
    /// The registration to write again whenever the lease is new.
    member: Option<v1::Member>,
    /// The lease and incarnation of the registration last written (etcd took it): while
    /// they are the current ones and its key was not seen to go, it is still in etcd.
    written: Option<(i64, u64)>,
    /// The round this agent runs.
    running: Option<Arc<v1::Round>>,
    /// The newest round this agent has seen: put back when etcd comes back without any
    /// (its data lost), so that round numbers and the restart count go on.
    known_round: Option<v1::Round>,
    /// Revoke the lease and take a new one at the next sync (this node fenced itself).
    abandon: bool,
    /// Why this node fenced itself, to write before its lease is revoked.
    fenced_word: Option<v1::Left>,
}

impl Registration {
    pub(super) fn member(&self) -> Option<&v1::Member> {
        self.member.as_ref()
    }

    /// The registration to write from now on (none: withdrawn).
    pub(super) fn set_member(&mut self, member: Option<v1::Member>) {
        self.member = member;
    }

    /// etcd took the registration with `lease` and `incarnation`; returns whether an
    /// earlier one was written on another lease (this one registers again).
    pub(super) fn written(&mut self, lease: i64, incarnation: u64) -> bool {
        let again = self.written.is_some_and(|(l, _)| l != lease);
        self.written = Some((lease, incarnation));
        again
    }

    /// Whether the registration last written was with `lease` and `incarnation`.
    pub(super) fn written_with(&self, lease: i64, incarnation: u64) -> bool {
        self.written == Some((lease, incarnation))
    }

    pub(super) fn running(&self) -> Option<&Arc<v1::Round>> {
        self.running.as_ref()
    }

    /// This node runs `round` now (none: no round).
    pub(super) fn runs(&mut self, round: Option<Arc<v1::Round>>) {
        // Written again on a new lease, the registration of a node that runs round R
        // asks for R at least: a coordinator that seals afresh on an etcd that lost its
        // data (a process that never saw R) then seals R or later
        // (`first_number_all_wait_for`), never a lower number, which this node would take
        // for an old round and ignore while the others ran it (found by the simulator:
        // seed 941517, a node killed and started again across empty restarts of etcd).
        if let (Some(m), Some(r)) = (self.member.as_mut(), round.as_deref()) {
            if m.wants_round < r.number {
                // Only then: a registration is shared with the view until changed.
                m.wants_round = r.number;
            }
        }
        self.running = round;
    }

    /// This agent saw `round`: kept if it is the newest.
    pub(super) fn saw(&mut self, round: &v1::Round) {
        if self
            .known_round
            .as_ref()
            .is_none_or(|k| k.number < round.number)
        {
            self.known_round = Some(round.clone());
        }
    }

    /// The newest round this agent knows (the one it runs, or a later one it saw), unless
    /// it is placed: a member's copy lists only it and its neighbour (put back, a round
    /// of two), and the whole one is what a placed round is not sent as (at 10,000
    /// members, 27.9 s of etcd's time; at 20,000, over its request limit).
    pub(super) fn round_to_put_back(&self) -> Option<&v1::Round> {
        [self.running.as_deref(), self.known_round.as_ref()]
            .into_iter()
            .flatten()
            .max_by_key(|r| r.number)
            .filter(|r| r.shards == 0)
    }

    /// This node fenced itself, for `word`: out of its round, and at the next contact
    /// with etcd it says why and gives up its lease.
    pub(super) fn fenced(&mut self, word: v1::Left) {
        self.fenced_word = Some(word);
        self.running = None;
        self.abandon = true;
    }

    pub(super) fn fenced_word(&self) -> Option<&v1::Left> {
        self.fenced_word.as_ref()
    }

    /// The fenced word was written, or cannot be: not again.
    pub(super) fn word_done(&mut self) {
        self.fenced_word = None;
    }

    /// Whether the lease is to be given up at the next sync.
    pub(super) fn abandoning(&self) -> bool {
        self.abandon
    }

    /// The fenced lease was revoked.
    pub(super) fn abandoned(&mut self) {
        self.abandon = false;
    }
}
