//! The in-process backend behind `--standalone`: one node, no external service.

use crate::{Change, Departure, Finish, Rendezvous, RendezvousError, Round, RoundMember, port};

/// A one-node rendezvous. Every round is sealed at once with this node as group rank 0 and
/// a fresh free port on `master_addr`.
#[derive(Debug)]
pub struct StandaloneRendezvous {
    run_id: String,
    master_addr: String,
    local_world_size: u32,
    rounds: u64,
    restarts: u32,
}

impl StandaloneRendezvous {
    /// A rendezvous for `local_world_size` workers whose store is reached at `master_addr`.
    pub fn new(run_id: String, master_addr: String, local_world_size: u32) -> Self {
        Self {
            run_id,
            master_addr,
            local_world_size,
            rounds: 0,
            restarts: 0,
        }
    }
}

impl Rendezvous for StandaloneRendezvous {
    fn backend(&self) -> &'static str {
        "standalone"
    }

    fn run_id(&self) -> &str {
        &self.run_id
    }

    async fn next_round(&mut self) -> Result<Round, RendezvousError> {
        // The port is reserved on the loopback address the workers will use; resolving
        // `localhost` to an address we cannot bind would surface here, not in a worker.
        let master_port = port::free_port(&self.master_addr)?;
        let round = Round {
            number: self.rounds,
            group_rank: 0,
            group_world_size: 1,
            base_rank: 0,
            world_size: self.local_world_size,
            master_addr: self.master_addr.clone(),
            master_port,
            restart_count: self.restarts,
            members: vec![RoundMember {
                node_id: "local".into(),
                addr: self.master_addr.clone(),
                group_rank: 0,
                base_rank: 0,
                local_world_size: self.local_world_size,
            }],
            reason: if self.rounds == 0 {
                "first round".into()
            } else {
                "restart after a worker failure".into()
            },
        };
        self.rounds += 1;
        Ok(round)
    }

    async fn changed(&mut self) -> Result<Change, RendezvousError> {
        std::future::pending().await
    }

    async fn record_failure(&mut self) -> Result<u32, RendezvousError> {
        self.restarts += 1;
        Ok(self.restarts)
    }

    async fn finish(&mut self, _timeout: std::time::Duration) -> Result<Finish, RendezvousError> {
        // One node (or nodes that know nothing of each other): nobody else to wait for.
        Ok(Finish::AllDone)
    }

    async fn depart(&mut self, _how: Departure) -> Result<(), RendezvousError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        // A minimal executor: these futures never wait on I/O.
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        let mut f = std::pin::pin!(f);
        loop {
            if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
                return v;
            }
        }
    }

    #[test]
    fn rounds_number_up_and_carry_the_restart_count() {
        let mut rdzv = StandaloneRendezvous::new("job".into(), "127.0.0.1".into(), 4);
        let first = block_on(rdzv.next_round()).unwrap();
        assert_eq!(first.number, 0);
        assert_eq!(first.world_size, 4);
        assert_eq!(first.group_world_size, 1);
        assert_eq!(first.restart_count, 0);
        assert_eq!(block_on(rdzv.record_failure()).unwrap(), 1);
        let second = block_on(rdzv.next_round()).unwrap();
        assert_eq!(second.number, 1);
        assert_eq!(second.restart_count, 1);
        assert_ne!(second.master_port, 0);
    }
}
