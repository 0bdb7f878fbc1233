//! The `static` backend: a fixed set of nodes, ranks and master given up front.
//!
//! This is Kubeflow's non-elastic "master mode" (`MASTER_ADDR`, `MASTER_PORT`, `WORLD_SIZE`,
//! `RANK` injected by the operator). Every node derives the same round from the same flags,
//! and the workers meet at the master's c10d store; the agents only wait for each other
//! once, before the first round ([`crate::static_gate`]). There is no elasticity; a failure
//! restart is local to the node, as in torchrun.

use crate::fixed::{Fixed, Group, Layout};
use crate::{RendezvousError, RoundMember};

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
    /// How long the first round waits for every node ([`crate::static_gate`]).
    pub join_timeout: std::time::Duration,
}

/// A rendezvous whose every round is the configured group.
pub type StaticRendezvous = Fixed<StaticConfig>;

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
        Ok(Fixed::with(config))
    }
}

impl Group for StaticConfig {
    const BACKEND: &'static str = "static";

    fn run_id(&self) -> &str {
        &self.run_id
    }

    fn layout(&self) -> Result<Layout, RendezvousError> {
        let members = (0..self.nnodes)
            .map(|i| {
                // Only the master's address is known; the others meet at its store.
                let addr = if i == 0 {
                    self.master_addr.clone()
                } else {
                    String::new()
                };
                RoundMember::unranked(format!("node{i}"), addr, self.local_world_size)
            })
            .collect();
        Ok(Layout {
            members,
            me: self.node_rank as usize,
            master_addr: self.master_addr.clone(),
            master_port: self.master_port,
        })
    }

    /// Every node of `--nnodes` is there before any worker starts ([`crate::static_gate`]).
    async fn gather(&self) -> Result<(), RendezvousError> {
        if self.nnodes < 2 {
            return Ok(());
        }
        crate::static_gate::gather(self).await
    }

    /// Looks at the master's store for a torchrun agent until it finds one: with torchrun
    /// on the master node its agent hosts the store, on another node its agent joins the
    /// store our master's rank 0 hosts; either way its keys show there once both sides
    /// connected, and the job could never form.
    async fn watch(&self, since: std::time::Instant) -> RendezvousError {
        use fsdp_store::tcpstore::{Found, SAME_LAUNCHER, has_torchrun_agent_keys, probe};
        if self.nnodes < 2 {
            return std::future::pending().await;
        }
        let patience = std::time::Duration::from_secs(2);
        loop {
            if let Found::TcpStore { keys: Some(keys) } =
                probe(&self.master_addr, self.master_port, patience).await
                && has_torchrun_agent_keys(&keys)
            {
                return RendezvousError::TorchrunPeer(format!(
                    "torchrun's agent keys are in the master's store at {}:{}: {SAME_LAUNCHER}",
                    self.master_addr, self.master_port
                ));
            }
            let every = fsdp_store::tcpstore::probe_every(self.nnodes, since.elapsed());
            tokio::time::sleep(every).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Rendezvous;

    fn config(node_rank: u32) -> StaticConfig {
        StaticConfig {
            run_id: "none".into(),
            nnodes: 3,
            node_rank,
            local_world_size: 2,
            master_addr: "10.0.0.1".into(),
            master_port: 29500,
            join_timeout: std::time::Duration::from_secs(600),
        }
    }

    #[test]
    fn node_rank_out_of_range_is_rejected_with_the_range() {
        let err = StaticRendezvous::new(config(3)).unwrap_err().to_string();
        assert!(err.contains("--node-rank 3"), "{err}");
        assert!(err.contains("0..2"), "{err}");
    }

    /// The three nodes of a group meet at node 0's gate on a real port (none starts
    /// before all are there), then each derives its block of ranks.
    #[tokio::test]
    async fn every_node_waits_for_the_others_then_derives_its_block_of_ranks() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let node = |rank: u32| {
            StaticRendezvous::new(StaticConfig {
                master_addr: "127.0.0.1".into(),
                master_port: port,
                ..config(rank)
            })
            .unwrap()
        };
        let (mut n0, mut n1, mut n2) = (node(0), node(1), node(2));
        // Two of three: neither gets a round.
        let two = async { tokio::join!(n0.next_round(), n2.next_round()) };
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(1500), two)
                .await
                .is_err(),
            "a round before node 1 came"
        );
        let (r0, r1, r2) = tokio::join!(n0.next_round(), n1.next_round(), n2.next_round());
        let (r0, r2) = (r0.unwrap(), r2.unwrap());
        assert_eq!(r1.unwrap().base_rank, 2);
        assert_eq!(r0.group_rank, 0);
        assert_eq!(r2.group_rank, 2);
        assert_eq!(r2.base_rank, 4);
        assert_eq!(r2.world_size, 6);
        assert_eq!(
            (r2.master_addr.as_str(), r2.master_port),
            ("127.0.0.1", port)
        );
        // The gate let go of the port: the workers' store can bind it.
        std::net::TcpListener::bind(("0.0.0.0", port)).expect("the master port is free");
        // A restart is local: no waiting.
        let again = tokio::time::timeout(std::time::Duration::from_secs(1), n2.next_round()).await;
        assert_eq!(again.unwrap().unwrap().number, 1);
    }
}
