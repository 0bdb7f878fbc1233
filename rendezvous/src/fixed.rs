//! The body the `standalone` and `static` backends share: a group that never changes,
//! whose rounds differ only in their number, their restart count and (standalone) the port.

use crate::{
    Change, Departure, Finish, NoRecords, Rendezvous, RendezvousError, Round, RoundMember,
};

/// A round's group as a fixed backend lays it out.
#[derive(Debug, Clone)]
pub struct Layout {
    /// Every node in rank order (ranks are assigned by [`Round::new`]).
    pub members: Vec<RoundMember>,
    /// This node's index in `members`.
    pub me: usize,
    pub master_addr: String,
    pub master_port: u16,
}

/// What sets one fixed backend apart from the other.
#[expect(
    async_fn_in_trait,
    reason = "driven through generics on the agent's single-threaded runtime, as `Rendezvous`"
)]
pub trait Group {
    /// The backend's name ([`Rendezvous::backend`]).
    const BACKEND: &'static str;

    fn run_id(&self) -> &str;

    /// The group of the next round; called once per round.
    fn layout(&self) -> Result<Layout, RendezvousError>;

    /// Waits, before the first round, until the group's other nodes are there; a group
    /// that cannot tell is there at once.
    async fn gather(&self) -> Result<(), RendezvousError> {
        Ok(())
    }

    /// Resolves when the group can never form (another node runs another launcher);
    /// `since` is when the rendezvous began. A group that cannot tell waits forever.
    async fn watch(&self, since: std::time::Instant) -> RendezvousError {
        let _ = since;
        std::future::pending().await
    }
}

/// A rendezvous whose every round is the same group: sealed at once, never changed by
/// another node, failures charged locally (as in torchrun).
#[derive(Debug)]
pub struct Fixed<G> {
    group: G,
    /// When the rendezvous began (for [`Group::watch`]).
    began: std::time::Instant,
    rounds: u64,
    restarts: u32,
    /// When each failure was charged (Unix ms), the last [`crate::CHARGES_KEPT`].
    charged_at_ms: Vec<u64>,
}

impl<G> Fixed<G> {
    pub(crate) fn with(group: G) -> Self {
        Self {
            group,
            began: std::time::Instant::now(),
            rounds: 0,
            restarts: 0,
            charged_at_ms: Vec::new(),
        }
    }
}

impl<G: Group> Rendezvous for Fixed<G> {
    /// Nodes that know nothing of each other share no records.
    type Records = NoRecords;

    fn records(&mut self) -> Option<&mut NoRecords> {
        None
    }

    fn backend(&self) -> &'static str {
        G::BACKEND
    }

    fn run_id(&self) -> &str {
        self.group.run_id()
    }

    async fn next_round(&mut self) -> Result<Round, RendezvousError> {
        if self.rounds == 0 {
            // Restarts are local, as in torchrun: only the first start waits.
            self.group.gather().await?;
        }
        let l = self.group.layout()?;
        let reason = if self.rounds == 0 {
            "first round"
        } else {
            "restart after a worker failure"
        };
        let mut round = Round::new(
            self.rounds,
            l.members,
            l.me,
            (l.master_addr, l.master_port),
            self.restarts,
            reason.into(),
        )
        .map_err(RendezvousError::InvalidConfig)?;
        round.charged_at_ms = self.charged_at_ms.clone();
        self.rounds += 1;
        Ok(round)
    }

    async fn changed(&mut self) -> Result<Change, RendezvousError> {
        Err(self.group.watch(self.began).await)
    }

    async fn record_failure(&mut self) -> Result<u32, RendezvousError> {
        self.restarts += 1;
        self.charged_at_ms.push(crate::unix_ms());
        if self.charged_at_ms.len() > crate::CHARGES_KEPT {
            self.charged_at_ms.remove(0);
        }
        Ok(self.restarts)
    }

    async fn finish(&mut self, _timeout: std::time::Duration) -> Result<Finish, RendezvousError> {
        // One node (or nodes that know nothing of each other): nobody else to wait for.
        Ok(Finish::AllDone)
    }

    async fn depart(
        &mut self,
        _how: Departure,
        _why: crate::LeftReason,
    ) -> Result<(), RendezvousError> {
        Ok(())
    }
}

/// Drives a future that never waits on I/O to completion (for the unit tests).
#[cfg(test)]
pub(crate) fn block_on<F: std::future::Future>(f: F) -> F::Output {
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
}
