//! The work in hand: the one op in flight (and one etcd was too busy for, waiting to go
//! again), the queued steps, the inputs that wait their turn, the commands that wait for
//! etcd, and the effects for the driver. The machine sends at most one op at a time;
//! this part keeps that so.

use std::collections::VecDeque;
use std::time::Instant;

use super::inbox::Inbox;
use super::io::{Command, CommandId, Effect, Input, Op};
use super::machine::Then;
use super::sync::Todo;

#[derive(Debug)]
pub(super) struct Flight {
    /// What the op in flight was for.
    awaiting: Option<Then>,
    /// The op in flight, kept to be sent again if etcd answers that it is overloaded.
    in_flight: Option<Op>,
    /// When the op in flight was sent.
    sent: Instant,
    /// An op to send at a set time, and when: one etcd was too busy for, or the next
    /// transaction of a placed round's seal. Until then the machine waits as if it were
    /// still in flight.
    retry: Option<(Instant, Then, Op)>,
    /// What is left to do before the next input is looked at.
    todo: VecDeque<Todo>,
    /// Inputs that came while an op was in flight or work was left.
    inbox: Inbox,
    /// Commands waiting for etcd, oldest first: served after the next sync, never
    /// answered with a transient error.
    pending: VecDeque<(CommandId, Command)>,
    /// A departure, served before anything queued (see [`Flight::leave`]).
    leaving: Option<(CommandId, Command)>,
    effects: Vec<Effect>,
}

impl Flight {
    pub(super) fn new(now: Instant) -> Self {
        Self {
            awaiting: None,
            in_flight: None,
            sent: now,
            retry: None,
            todo: VecDeque::new(),
            inbox: Inbox::default(),
            pending: VecDeque::new(),
            leaving: None,
            effects: Vec::new(),
        }
    }

    /// Sends `op` at `now`; its answer goes to `then`.
    pub(super) fn issue(&mut self, now: Instant, then: Then, op: Op) {
        debug_assert!(self.awaiting.is_none(), "one op at a time");
        self.sent = now;
        self.awaiting = Some(then);
        self.in_flight = Some(op.clone());
        self.effects.push(Effect::Etcd(op));
    }

    /// Whether an op is in flight (its answer is the next input that counts).
    pub(super) fn busy(&self) -> bool {
        self.awaiting.is_some()
    }

    pub(super) fn awaiting(&self) -> Option<&Then> {
        self.awaiting.as_ref()
    }

    /// The answer came: what it was for.
    pub(super) fn answered(&mut self) -> Option<Then> {
        self.awaiting.take()
    }

    /// The op answered, no longer to be sent again.
    pub(super) fn done(&mut self) -> Option<Op> {
        self.in_flight.take()
    }

    /// The op in flight, if one is.
    pub(super) fn in_flight(&self) -> Option<&Op> {
        self.in_flight.as_ref()
    }

    /// When the op in flight (or the last one) was sent.
    pub(super) fn sent(&self) -> Instant {
        self.sent
    }

    /// `op`, for `then`, goes again at `at`.
    pub(super) fn retry_at(&mut self, at: Instant, then: Then, op: Op) {
        self.retry = Some((at, then, op));
    }

    pub(super) fn retry_due(&self) -> Option<Instant> {
        self.retry.as_ref().map(|(at, ..)| *at)
    }

    /// The op waiting to go again, taken out.
    pub(super) fn take_retry(&mut self) -> Option<(Then, Op)> {
        self.retry.take().map(|(_, then, op)| (then, op))
    }

    pub(super) fn then(&mut self, todo: Todo) {
        self.todo.push_back(todo);
    }

    pub(super) fn then_all(&mut self, todos: impl IntoIterator<Item = Todo>) {
        self.todo.extend(todos);
    }

    /// `todo` before everything else queued.
    pub(super) fn first(&mut self, todo: Todo) {
        self.todo.push_front(todo);
    }

    pub(super) fn next_todo(&mut self) -> Option<Todo> {
        self.todo.pop_front()
    }

    pub(super) fn idle(&self) -> bool {
        self.todo.is_empty()
    }

    /// Drops whatever was queued and queues `plan`.
    pub(super) fn plan(&mut self, plan: Vec<Todo>) {
        self.todo = plan.into();
    }

    pub(super) fn queue(&mut self, input: Input) {
        self.inbox.push_back(input);
    }

    pub(super) fn next_input(&mut self) -> Option<Input> {
        self.inbox.pop_front()
    }

    pub(super) fn inbox(&self) -> &Inbox {
        &self.inbox
    }

    /// Every queued input, oldest first; those `rest` gives back wait again.
    pub(super) fn sort_inputs(&mut self, mut take: impl FnMut(Input) -> Option<Input>) {
        let mut rest = Inbox::default();
        for input in self.inbox.take() {
            if let Some(back) = take(input) {
                rest.push_back(back);
            }
        }
        self.inbox = rest;
    }

    /// Stream events queued before now belong to streams now closed: only commands and
    /// proofs stay.
    pub(super) fn drop_stream_events(&mut self) {
        self.inbox.retain(|i| {
            matches!(
                i,
                Input::Command(..) | Input::CommandsClosed | Input::NoLeader { .. }
            )
        });
    }

    /// What a keep-alive stream said and was not read yet: that stream is being closed.
    pub(super) fn drop_keep_alive_events(&mut self) {
        self.inbox
            .retain(|i| !matches!(i, Input::LeaseAnswer(_) | Input::KeepAliveFailed(_)));
    }

    /// `command` waits for etcd, after those waiting.
    pub(super) fn wait(&mut self, id: CommandId, command: Command) {
        self.pending.push_back((id, command));
    }

    /// `command` waits for etcd, before those waiting (it was being served).
    pub(super) fn wait_first(&mut self, waiting: (CommandId, Command)) {
        self.pending.push_front(waiting);
    }

    pub(super) fn next_waiting(&mut self) -> Option<(CommandId, Command)> {
        self.pending.pop_front()
    }

    /// `departure` goes as soon as no op is in flight (a command of several ops ends
    /// first), before any todo, retry, queued input or waiting command: it needs nothing
    /// of the run, and the session ends with its answer. Queued behind the rest, one node
    /// of 10,000 leaving together (busy with the others' departures, the coordinator most
    /// likely) had not left after a minute.
    pub(super) fn leave(&mut self, id: CommandId, departure: Command) {
        debug_assert!(matches!(departure, Command::Depart { .. }));
        // A second one waits, and is answered when the first ends the session.
        if self.leaving.is_some() {
            self.pending.push_back((id, departure));
        } else {
            self.leaving = Some((id, departure));
        }
    }

    pub(super) fn take_leaving(&mut self) -> Option<(CommandId, Command)> {
        self.leaving.take()
    }

    /// The session ended: every command still waiting or queued, to be told why; and the
    /// queued work dropped.
    pub(super) fn abandon_all(&mut self) -> Vec<CommandId> {
        self.todo.clear();
        self.leaving
            .take()
            .into_iter()
            .chain(self.pending.drain(..))
            .map(|(id, _)| id)
            .chain(self.inbox.take().into_iter().filter_map(|i| match i {
                Input::Command(id, _) => Some(id),
                _ => None,
            }))
            .collect()
    }

    pub(super) fn emit(&mut self, effect: Effect) {
        self.effects.push(effect);
    }

    pub(super) fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }
}
