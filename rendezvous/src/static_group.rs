//! The `static` backend: a fixed set of nodes, ranks and master given up front.
//!
//! This is Kubeflow's non-elastic "master mode" (`MASTER_ADDR`, `MASTER_PORT`, `WORLD_SIZE`,
//! `RANK` injected by the operator). Nothing is exchanged between agents: every node derives
//! the same round from the same flags, and the workers meet at the master's c10d store.
//! There is no elasticity; a failure restart is local to the node, as in torchrun.

use crate::{Change, Departure, Finish, Rendezvous, RendezvousError, Round, RoundMember, ranks};

/// Configuration of a static group.
#[derive(Debug, Clone)]
pub struct StaticConfig {
    pub run_id: String,
    /// Number of nodes (`--nnodes N`).
    pub nnodes: u32,
    /// This node's rank (`--node-rank`).
    pub node_rank: u32,
    /// Workers per node; static groups are homogeneous, as in torchrun.
    pub local_world_size: u32,
    pub master_addr: String,
    pub master_port: u16,
}

/// A rendezvous whose every round is the configured group.
#[derive(Debug)]
pub struct StaticRendezvous {
    config: StaticConfig,
    rounds: u64,
    restarts: u32,
}

impl StaticRendezvous {
    /// Checks that the node rank fits the group.
    pub fn new(config: StaticConfig) -> Result<Self, RendezvousError> {
        if config.node_rank >= config.nnodes {
            return Err(RendezvousError::InvalidConfig(format!(
                "--node-rank {} is out of range for --nnodes {} (node ranks are 0..{})",
                config.node_rank,
                config.nnodes,
                config.nnodes - 1
            )));
        }
        Ok(Self {
            config,
            rounds: 0,
            restarts: 0,
        })
    }
}

impl Rendezvous for StaticRendezvous {
    fn backend(&self) -> &'static str {
        "static"
    }

    fn run_id(&self) -> &str {
        &self.config.run_id
    }

    async fn next_round(&mut self) -> Result<Round, RendezvousError> {
        let c = &self.config;
        let sizes = vec![c.local_world_size; c.nnodes as usize];
        let (all, world_size) = ranks::assign(&sizes).map_err(RendezvousError::InvalidConfig)?;
        let mine = all[c.node_rank as usize];
        let round = Round {
            number: self.rounds,
            group_rank: mine.group_rank,
            group_world_size: c.nnodes,
            base_rank: mine.base_rank,
            world_size,
            master_addr: c.master_addr.clone(),
            master_port: c.master_port,
            restart_count: self.restarts,
            members: all
                .iter()
                .enumerate()
                .map(|(i, r)| RoundMember {
                    node_id: format!("node{i}"),
                    addr: if i == 0 {
                        c.master_addr.clone()
                    } else {
                        String::new()
                    },
                    group_rank: r.group_rank,
                    base_rank: r.base_rank,
                    local_world_size: c.local_world_size,
                })
                .collect(),
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

    fn config(node_rank: u32) -> StaticConfig {
        StaticConfig {
            run_id: "none".into(),
            nnodes: 3,
            node_rank,
            local_world_size: 2,
            master_addr: "10.0.0.1".into(),
            master_port: 29500,
        }
    }

    #[test]
    fn node_rank_out_of_range_is_rejected_with_the_range() {
        let err = StaticRendezvous::new(config(3)).unwrap_err().to_string();
        assert!(err.contains("--node-rank 3"), "{err}");
        assert!(err.contains("0..2"), "{err}");
    }

    #[test]
    fn every_node_derives_its_block_of_ranks() {
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        let mut rdzv = StaticRendezvous::new(config(2)).unwrap();
        let mut fut = std::pin::pin!(rdzv.next_round());
        let std::task::Poll::Ready(Ok(round)) = fut.as_mut().poll(&mut cx) else {
            panic!("a static round is ready at once");
        };
        assert_eq!(round.group_rank, 2);
        assert_eq!(round.base_rank, 4);
        assert_eq!(round.world_size, 6);
        assert_eq!(round.master_addr, "10.0.0.1");
        assert_eq!(round.master_port, 29500);
    }
}
