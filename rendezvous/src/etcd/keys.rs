//! The key layout of one run (documented in docs/rendezvous.md).
//!
//! ```text
//! <prefix>/<run_id>/members/<node_id>    Member       lease-bound: present while the agent lives
//! <prefix>/<run_id>/ctl/round            Round        the sealed round, fenced by its mod revision
//! <prefix>/<run_id>/ctl/master           Master       where the round's workers meet
//! <prefix>/<run_id>/ctl/failures/<n>     Failure      first failure reported in round n
//! <prefix>/<run_id>/ctl/coordinator      Coordinator  lease-bound election key
//! <prefix>/<run_id>/ctl/done/<n>/<node>  Done         the node's workers all succeeded in round n
//! <prefix>/<run_id>/ctl/gone/<n>/<node>  Gone         how the node's loss from round n was noticed
//! <prefix>/<run_id>/ctl/hang/<n>/<node>  HangReport   where the node's ranks were when round n hung
//! <prefix>/<run_id>/ctl/halt             Halt         the run is over for every node, with this code
//! <prefix>/<run_id>/ctl/unhealthy/<node> Unhealthy    lease-bound: the node's health check fails
//! <prefix>/<run_id>/ctl/faults/<n>/<node> Fault       the node saw its own worker fail in round n
//! <prefix>/<run_id>/ctl/quarantine/<machine> Quarantine the machine is kept out until a time
//! ```
//!
//! Members and control keys live under different prefixes so that agents can watch member
//! departures without receiving every registration (only the coordinator needs those).

/// The segments a run's own keys use under its root.
pub const RESERVED: &[&str] = &["members", "ctl"];

/// Keys of one run.
#[derive(Debug, Clone)]
pub struct Keys {
    root: String,
}

impl Keys {
    /// Keys under `<prefix>/<run_id>/`. The run id must be a single path segment.
    ///
    /// Neither the prefix nor the run id may use the segments a run's own keys use
    /// ([`RESERVED`]), so one run's root can never fall inside another run's `members/` or
    /// `ctl/`. A root inside another run's root (prefix `/fsdp/train` beside run `train`
    /// under `/fsdp`) is refused against etcd at join time, and a run ignores the keys
    /// of such a nested run (see [`Keys::nested_run_key`]).
    pub fn new(prefix: &str, run_id: &str) -> Result<Self, String> {
        if run_id.is_empty() || run_id.contains('/') || run_id.chars().any(char::is_control) {
            return Err(format!(
                "run id '{run_id}' must be non-empty and contain no '/'"
            ));
        }
        if RESERVED.contains(&run_id) {
            return Err(format!(
                "run id '{run_id}' is a name the run's own keys use ({}); pick another --rdzv-id",
                RESERVED.join(", ")
            ));
        }
        let prefix = prefix.trim_end_matches('/');
        if !prefix.is_empty() {
            let fix = "write it as /name or /team/name (e.g. the default /fsdp)";
            let Some(rest) = prefix.strip_prefix('/') else {
                return Err(format!("etcd_prefix '{prefix}' must start with '/'; {fix}"));
            };
            for seg in rest.split('/') {
                if seg.is_empty() || seg == "." || seg == ".." || seg.chars().any(char::is_control)
                {
                    return Err(format!(
                        "etcd_prefix '{prefix}' has an empty, '.', '..' or control-character segment; {fix}"
                    ));
                }
                if RESERVED.contains(&seg) {
                    return Err(format!(
                        "etcd_prefix '{prefix}' contains '{seg}', a name a run's own keys use ({}): \
                         it would put this run's keys inside another run's; {fix}",
                        RESERVED.join(", ")
                    ));
                }
            }
        }
        Ok(Self {
            root: format!("{prefix}/{run_id}/"),
        })
    }

    /// The roots another run would have if this run's keys lay inside it: every proper
    /// ancestor of this run's root, nearest first (`/fsdp/a/x/` → `/fsdp/a/`, `/fsdp/`, `/`).
    pub fn enclosing_roots(&self) -> Vec<String> {
        let trimmed = self.root.trim_end_matches('/');
        let mut out = Vec::new();
        let mut end = trimmed.len();
        while let Some(i) = trimmed[..end].rfind('/') {
            out.push(trimmed[..=i].to_owned());
            end = i;
        }
        out
    }

    /// Whether `key`, under this run's root, belongs to another run nested inside it
    /// (its root below ours): `<root><segments>/members/...` or `<root><segments>/ctl/...`.
    pub fn nested_run_key(&self, key: &str) -> bool {
        let Some(rest) = key.strip_prefix(&self.root) else {
            return false;
        };
        let segs: Vec<&str> = rest.split('/').collect();
        segs.len() > 2 && segs[1..segs.len() - 1].iter().any(|s| RESERVED.contains(s))
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

    pub fn gone_prefix(&self) -> String {
        format!("{}ctl/gone/", self.root)
    }

    pub fn gone(&self, round: u64, node_id: &str) -> String {
        format!("{}ctl/gone/{round:020}/{node_id}", self.root)
    }

    pub fn faults_prefix(&self) -> String {
        format!("{}ctl/faults/", self.root)
    }

    pub fn fault(&self, round: u64, node_id: &str) -> String {
        format!("{}ctl/faults/{round:020}/{node_id}", self.root)
    }

    pub fn quarantine_prefix(&self) -> String {
        format!("{}ctl/quarantine/", self.root)
    }

    pub fn quarantine(&self, machine: &str) -> String {
        format!("{}ctl/quarantine/{machine}", self.root)
    }

    pub fn unhealthy_prefix(&self) -> String {
        format!("{}ctl/unhealthy/", self.root)
    }

    pub fn unhealthy(&self, node_id: &str) -> String {
        format!("{}ctl/unhealthy/{node_id}", self.root)
    }

    pub fn halt(&self) -> String {
        format!("{}ctl/halt", self.root)
    }

    pub fn hang_prefix(&self) -> String {
        format!("{}ctl/hang/", self.root)
    }

    pub fn hang(&self, round: u64, node_id: &str) -> String {
        format!("{}ctl/hang/{round:020}/{node_id}", self.root)
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

    #[test]
    fn a_prefix_cannot_reach_into_another_runs_keys() {
        for bad in [
            "/fsdp/train/members",
            "/fsdp/train/ctl",
            "/a//b",
            "fsdp",
            "/a/../b",
        ] {
            let e = Keys::new(bad, "x").unwrap_err();
            assert!(e.contains("etcd_prefix"), "{bad}: {e}");
        }
        assert!(Keys::new("/fsdp", "members").is_err());
        assert!(Keys::new("/fsdp", "ctl").is_err());
        assert_eq!(Keys::new("/", "j").unwrap().root(), "/j/");
        assert_eq!(Keys::new("", "j").unwrap().root(), "/j/");
        assert_eq!(Keys::new("/team/a/", "j").unwrap().root(), "/team/a/j/");
    }

    #[test]
    fn enclosing_roots_are_every_proper_ancestor() {
        let k = Keys::new("/fsdp/train", "x").unwrap();
        assert_eq!(k.enclosing_roots(), ["/fsdp/train/", "/fsdp/", "/"]);
    }

    #[test]
    fn keys_of_a_nested_run_are_told_from_foreign_ones() {
        let k = Keys::new("/fsdp", "train").unwrap();
        assert!(k.nested_run_key("/fsdp/train/x/members/n1"));
        assert!(k.nested_run_key("/fsdp/train/a/b/ctl/round"));
        assert!(!k.nested_run_key("/fsdp/train/members/n1"));
        assert!(!k.nested_run_key("/fsdp/train/other"));
        assert!(!k.nested_run_key("/fsdp/train/x/members"));
        assert!(!k.nested_run_key("/fsdp/other/x/members/n"));
    }
}
