//! The key layout of one run (documented in docs/rendezvous.md).
//!
//! ```text
//! <prefix>/<run_id>/members/<node_id>    Member       lease-bound: present while the agent lives
//! <prefix>/<run_id>/ctl/round            Round        the sealed round, fenced by its mod revision
//! <prefix>/<run_id>/ctl/master           Master       where the round's workers meet
//! <prefix>/<run_id>/ctl/failures/<n>     Failure      first failure reported in round n
//! <prefix>/<run_id>/ctl/coordinator      Coordinator  lease-bound election key
//! <prefix>/<run_id>/ctl/done/<n>/<node>  Done         the node's workers all succeeded in round n
//! ```
//!
//! Members and control keys live under different prefixes so that agents can watch member
//! departures without receiving every registration (only the coordinator needs those).

/// Keys of one run.
#[derive(Debug, Clone)]
pub struct Keys {
    root: String,
}

impl Keys {
    /// Keys under `<prefix>/<run_id>/`. The run id must be a single path segment.
    pub fn new(prefix: &str, run_id: &str) -> Result<Self, String> {
        if run_id.is_empty() || run_id.contains('/') || run_id.chars().any(char::is_control) {
            return Err(format!(
                "run id '{run_id}' must be non-empty and contain no '/'"
            ));
        }
        let prefix = prefix.trim_end_matches('/');
        Ok(Self {
            root: format!("{prefix}/{run_id}/"),
        })
    }

    pub fn root(&self) -> &str {
        &self.root
    }

    pub fn members(&self) -> String {
        format!("{}members/", self.root)
    }

    pub fn member(&self, node_id: &str) -> String {
        format!("{}members/{node_id}", self.root)
    }

    pub fn ctl(&self) -> String {
        format!("{}ctl/", self.root)
    }

    pub fn round(&self) -> String {
        format!("{}ctl/round", self.root)
    }

    pub fn master(&self) -> String {
        format!("{}ctl/master", self.root)
    }

    pub fn failures(&self) -> String {
        format!("{}ctl/failures/", self.root)
    }

    pub fn failure(&self, round: u64) -> String {
        format!("{}ctl/failures/{round:020}", self.root)
    }

    pub fn done_prefix(&self) -> String {
        format!("{}ctl/done/", self.root)
    }

    pub fn done(&self, round: u64, node_id: &str) -> String {
        format!("{}ctl/done/{round:020}/{node_id}", self.root)
    }

    pub fn coordinator(&self) -> String {
        format!("{}ctl/coordinator", self.root)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout() {
        let k = Keys::new("/fsdp/", "job42").unwrap();
        assert_eq!(k.member("n1"), "/fsdp/job42/members/n1");
        assert_eq!(k.round(), "/fsdp/job42/ctl/round");
        assert_eq!(
            k.failure(7),
            "/fsdp/job42/ctl/failures/00000000000000000007"
        );
        assert!(k.failure(7).starts_with(&k.failures()));
        assert!(Keys::new("/fsdp", "a/b").is_err());
        assert!(Keys::new("/fsdp", "").is_err());
    }
}
