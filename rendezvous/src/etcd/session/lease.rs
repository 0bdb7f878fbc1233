//! The lease keeper: the lease this node's keys live on, the incarnation of its
//! registration, what the session saw of etcd's clock for it, and when the next
//! keep-alive is due. Only the session replaces the lease, so a lease found gone is
//! replaced exactly once.

use std::time::{Duration, Instant};

use crate::fence::LeaseClock;

#[derive(Debug)]
pub(super) struct LeaseKeeper {
    id: i64,
    /// This agent's registrations so far ([`fsdp_proto::v1::Member`]'s `incarnation`): a
    /// new lease, or a registration written again after its key was deleted, is the next
    /// one.
    incarnation: u64,
    clock: LeaseClock,
    /// When the next keep-alive is due; none while no stream is open.
    keep_alive_at: Option<Instant>,
    /// etcd ended the keep-alive stream for load: the next keep-alive needs a new one.
    stream_ended: bool,
    /// The lease whose keep-alive stream a joining node opened right after its grant,
    /// before its watches (`Todo::KeepFromGrant`); none once the streams are closed,
    /// or once the watches replace it or open over it.
    kept_from_grant: Option<i64>,
    /// etcd said this lease is gone: what keep-alives sent before that bring back says
    /// nothing new.
    gone: bool,
    /// How long the last keep-alive answered took (from its send to the machine taking
    /// its answer): one that has waited no longer, and a little more, is as slow as
    /// etcd (or this host) has been, not a sign that it stopped.
    last_latency: Option<Duration>,
}

impl LeaseKeeper {
    /// The lease granted at `granted_at`, with `ttl`.
    pub(super) fn new(id: i64, incarnation: u64, granted_at: Instant, ttl: Duration) -> Self {
        let mut clock = LeaseClock::default();
        clock.replaced(granted_at, ttl);
        Self {
            id,
            incarnation,
            clock,
            keep_alive_at: None,
            stream_ended: false,
            kept_from_grant: None,
            gone: false,
            last_latency: None,
        }
    }

    pub(super) fn id(&self) -> i64 {
        self.id
    }

    pub(super) fn incarnation(&self) -> u64 {
        self.incarnation
    }

    pub(super) fn clock(&self) -> &LeaseClock {
        &self.clock
    }

    /// The next registration is a new incarnation; returns it.
    pub(super) fn next_incarnation(&mut self) -> u64 {
        self.incarnation += 1;
        self.incarnation
    }

    /// Lease `id`, granted by a request sent at `sent`, replaced the old one: what was
    /// known of the old one no longer counts.
    pub(super) fn replaced(&mut self, id: i64, sent: Instant, ttl: Duration) {
        self.clock.replaced(sent, ttl);
        self.id = id;
        self.gone = false;
    }

    /// etcd said the lease is gone; false if that was its last word already.
    pub(super) fn first_word_of_its_end(&mut self) -> bool {
        !std::mem::replace(&mut self.gone, true)
    }

    /// A request sent at `sent` found the lease with `left` to live (etcd's last word:
    /// an ended keep-alive stream is taken for a lease gone, and the lease may stand).
    pub(super) fn confirmed(&mut self, sent: Instant, left: Duration) {
        self.clock.confirmed(sent, left);
        self.gone = false;
    }

    /// The oldest unanswered keep-alive was answered at `now` with `left` to live.
    pub(super) fn answered(&mut self, now: Instant, left: Duration) {
        if let Some(sent) = self.clock.oldest_unanswered() {
            self.last_latency = Some(now.saturating_duration_since(sent));
        }
        self.clock.keep_alive_answered(left);
        self.gone = false;
    }

    /// How long the last keep-alive answered took (any lease this node held).
    pub(super) fn last_latency(&self) -> Option<Duration> {
        self.last_latency
    }

    /// etcd was seen without a leader at `sent` ([`LeaseClock::no_leader_at`]).
    pub(super) fn no_leader_at(&mut self, sent: Instant, ttl: Duration) {
        self.clock.no_leader_at(sent, ttl);
    }

    /// When the next keep-alive is due, while a stream is open.
    pub(super) fn keep_alive_due(&self) -> Option<Instant> {
        self.keep_alive_at
    }

    /// Whether the keep-alive stream ended and the next keep-alive needs a new one.
    pub(super) fn stream_ended(&self) -> bool {
        self.stream_ended
    }

    /// Keep-alives from `now` on (the watches are open).
    pub(super) fn start(&mut self, now: Instant) {
        self.keep_alive_at = Some(now);
    }

    /// No keep-alives until [`LeaseKeeper::start`]: the streams are closed.
    pub(super) fn stop(&mut self) {
        self.keep_alive_at = None;
        self.kept_from_grant = None;
    }

    /// A keep-alive stream for the lease held was opened at `now`, before the watches:
    /// the next keep-alive a third of a TTL later.
    pub(super) fn keep_from_grant(&mut self, now: Instant, ttl: Duration) {
        self.kept_from_grant = Some(self.id);
        self.later(now, ttl);
    }

    /// The stream kept from the grant is no longer a joining node's own: the watches'
    /// open closes it, or they are open over it and it is theirs.
    pub(super) fn kept_from_grant_over(&mut self) {
        self.kept_from_grant = None;
    }

    /// The lease kept alive since its grant, while no watches are open.
    pub(super) fn kept_from_grant(&self) -> Option<i64> {
        self.kept_from_grant
    }

    /// The next keep-alive a third of a TTL from `now`.
    pub(super) fn later(&mut self, now: Instant, ttl: Duration) {
        self.keep_alive_at = Some(now + ttl / 3);
    }

    /// A keep-alive leaves at `now`; the next is due a third of a TTL later.
    pub(super) fn sent(&mut self, now: Instant, ttl: Duration) {
        self.clock.keep_alive_sent(now);
        self.later(now, ttl);
    }

    /// etcd ended the keep-alive stream for load: a keep-alive on a new one, due at `now`
    /// when `at_once`.
    pub(super) fn ended(&mut self, at_once: Option<Instant>) {
        self.stream_ended = true;
        if let Some(now) = at_once {
            self.keep_alive_at = Some(now);
        }
    }

    /// A new keep-alive stream is open: the keep-alives sent on the old one will never be
    /// answered, and the next answer pairs with one sent on this one.
    pub(super) fn stream_opened(&mut self) {
        self.stream_ended = false;
        self.clock.stream_closed();
    }
}
