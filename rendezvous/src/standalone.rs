//! The in-process backend behind `--standalone`: one node, no external service.

use crate::fixed::{Fixed, Group, Layout};
use crate::{RendezvousError, RoundMember, port};

/// A one-node rendezvous. Every round is sealed at once with this node as group rank 0 and
/// a fresh free port on `master_addr`.
pub type StandaloneRendezvous = Fixed<Standalone>;

/// The one node of a standalone run.
#[derive(Debug)]
pub struct Standalone {
    run_id: String,
    master_addr: String,
    local_world_size: u32,
}

impl StandaloneRendezvous {
    /// A rendezvous for `local_world_size` workers whose store is reached at `master_addr`.
    pub fn new(run_id: String, master_addr: String, local_world_size: u32) -> Self {
        Fixed::with(Standalone {
            run_id,
            master_addr,
            local_world_size,
        })
    }
}

impl Group for Standalone {
    const BACKEND: &'static str = "standalone";

    fn run_id(&self) -> &str {
        &self.run_id
    }

    fn layout(&self) -> Result<Layout, RendezvousError> {
        // The port is reserved on the loopback address the workers will use; resolving
        // `localhost` to an address we cannot bind would surface here, not in a worker.
        let master_port = port::free_port(&self.master_addr)?;
        let me = RoundMember::unranked(
            "local".into(),
            self.master_addr.clone(),
            self.local_world_size,
        );
        Ok(Layout {
            members: vec![me],
            me: 0,
            master_addr: self.master_addr.clone(),
            master_port,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Rendezvous;
    use crate::fixed::block_on;

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
