//! The inputs that wait while an op is in flight, with what the driver asks of them on
//! every step kept as counts: how many bytes of watch events wait, and whether a
//! keep-alive answer does. Counted by scanning the queue on each step instead, a first
//! round arriving at 4,000 simulated nodes queued thousands of inputs per node and the
//! scans were 10% of the bench's CPU.

use std::collections::VecDeque;

use super::io::{Input, WatchEvent};

#[derive(Debug, Default)]
pub(super) struct Inbox {
    queue: VecDeque<Input>,
    /// Bytes of the watch events queued (see [`WatchEvent::size`]).
    bytes: usize,
    /// Keep-alive answers queued.
    lease_answers: usize,
}

/// What one input adds to the counts.
fn weight(input: &Input) -> (usize, usize) {
    match input {
        Input::Watched(events) => (events.iter().map(WatchEvent::size).sum(), 0),
        Input::LeaseAnswer(_) => (0, 1),
        _ => (0, 0),
    }
}

impl Inbox {
    pub(super) fn push_back(&mut self, input: Input) {
        let (bytes, answers) = weight(&input);
        self.bytes += bytes;
        self.lease_answers += answers;
        self.queue.push_back(input);
    }

    pub(super) fn pop_front(&mut self) -> Option<Input> {
        let input = self.queue.pop_front()?;
        self.forget(&input);
        Some(input)
    }

    /// Keeps the inputs `keep` says yes to.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(&Input) -> bool) {
        let kept: VecDeque<Input> = self.take().into_iter().filter(|i| keep(i)).collect();
        for input in kept {
            self.push_back(input);
        }
    }

    /// Every input, oldest first; the inbox is left empty.
    pub(super) fn take(&mut self) -> VecDeque<Input> {
        (self.bytes, self.lease_answers) = (0, 0);
        std::mem::take(&mut self.queue)
    }

    /// About how many bytes of watch events wait.
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether a keep-alive answer waits.
    pub(super) fn holds_lease_answer(&self) -> bool {
        self.lease_answers > 0
    }

    /// Whether the end of a keep-alive stream waits (asked once per watches' open: a
    /// scan).
    pub(super) fn holds_keep_alive_end(&self) -> bool {
        self.queue.iter().any(Input::ends_keep_alive)
    }

    fn forget(&mut self, input: &Input) {
        let (bytes, answers) = weight(input);
        self.bytes -= bytes;
        self.lease_answers -= answers;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::etcd::session::io::Kv;

    fn watched(bytes: usize) -> Input {
        Input::Watched(vec![WatchEvent::Put(Kv {
            key: "k".into(),
            value: vec![0; bytes - 1],
            create_rev: 1,
            mod_rev: 1,
            lease: 0,
        })])
    }

    #[test]
    fn the_counts_follow_what_comes_and_goes() {
        let mut inbox = Inbox::default();
        inbox.push_back(watched(100));
        inbox.push_back(Input::LeaseAnswer(Some(5)));
        inbox.push_back(watched(50));
        assert_eq!((inbox.bytes(), inbox.holds_lease_answer()), (150, true));
        assert!(matches!(inbox.pop_front(), Some(Input::Watched(_))));
        assert_eq!((inbox.bytes(), inbox.holds_lease_answer()), (50, true));
        inbox.retain(|i| !matches!(i, Input::LeaseAnswer(_)));
        assert_eq!((inbox.bytes(), inbox.holds_lease_answer()), (50, false));
        assert_eq!(inbox.take().len(), 1);
        assert_eq!((inbox.bytes(), inbox.holds_lease_answer()), (0, false));
        assert!(inbox.pop_front().is_none());
    }
}
