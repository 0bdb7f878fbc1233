//! The keys of one run: its root `<prefix>/<run_id>/`, and each record's key under it as
//! the record declares it ([`super::record`]; the layout is in docs/rendezvous.md).
//!
//! Members and control keys live under different prefixes (`members/`, `ctl/`) so that
//! agents can watch member departures without receiving every registration (only the
//! coordinator needs those).

use super::record::{Place, Record};

/// Where a placed round's shards are under a run's root.
const PLACEMENTS: &str = "placement/";

/// Where a forming crowd's admission keys are under a run's root
/// ([`crate::etcd::session::Turn`]).
const ADMISSIONS: &str = "admit/";

/// The segments a run's own keys use under its root.
pub const RESERVED: &[&str] = &["members", "ctl", "placement", "admit"];

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

    /// The ranges `[from, to)` under the root that hold none of this run's own keys
    /// (`admit/…`, `ctl/…`, `members/…`, `placement/…`, `roster`): where another run
    /// nested in this one keeps its keys ([`Keys::nested_run_key`]). Reading them costs
    /// what they hold, not what the run holds; a nested run's root cannot have a segment
    /// of [`RESERVED`] ([`Keys::new`]), so it is never inside one of the run's prefixes.
    pub fn foreign_ranges(&self) -> [(String, String); 6] {
        let r = &self.root;
        [
            (r.clone(), self.admissions()),
            (past(&self.admissions()), format!("{r}ctl/")),
            (past(&self.ctl()), self.members()),
            (past(&self.members()), self.placements()),
            (past(&self.placements()), format!("{r}roster")),
            // Past the roster key itself, to the end of the root.
            (format!("{r}roster\0"), past(r)),
        ]
    }

    pub fn root(&self) -> &str {
        &self.root
    }

    /// The prefix of every registration (`members/`), watched apart from the rest.
    pub fn members(&self) -> String {
        self.key::<fsdp_proto::v1::Member>("")
    }

    /// The prefix of every other record (`ctl/`).
    pub fn ctl(&self) -> String {
        format!("{}ctl/", self.root)
    }

    /// The prefix of a placed round's shards (`placement/`), outside `ctl/`: each member
    /// reads only its own ([`crate::etcd::placement`]).
    pub fn placements(&self) -> String {
        format!("{}{PLACEMENTS}", self.root)
    }

    /// Whether `key` is a placed round's shard: every watch event of the coordinator's is
    /// asked, so no key is built for it.
    pub fn is_placement(&self, key: &str) -> bool {
        key.strip_prefix(&self.root)
            .is_some_and(|rest| rest.starts_with(PLACEMENTS))
    }

    /// The prefix of a forming crowd's admission keys (`admit/`), outside `ctl/`: only
    /// the nodes that wait for their turn watch them.
    pub fn admissions(&self) -> String {
        format!("{}{ADMISSIONS}", self.root)
    }

    /// Admission key `n` ([`crate::etcd::session::Turn`]), numbered so that keys sort as
    /// their numbers do.
    pub fn admission(&self, n: u32) -> String {
        format!("{}{n:06}", self.admissions())
    }

    /// Whether `key` is an admission key: read apart, as a placed round's shards are.
    pub fn is_admission(&self, key: &str) -> bool {
        key.strip_prefix(&self.root)
            .is_some_and(|rest| rest.starts_with(ADMISSIONS))
    }

    /// The prefix of the shards of one attempt to seal a placed round (its header's
    /// `placement`, [`crate::etcd::placement::tag`]).
    pub fn placement_of(&self, tag: &str) -> String {
        format!("{}{tag}/", self.placements())
    }

    /// The key of shard `shard` of the placed round whose shards are under `tag`.
    pub fn placement(&self, tag: &str, shard: u32) -> String {
        format!("{}{shard:05}", self.placement_of(tag))
    }

    /// The ranges `[from, to)` that hold every shard under `placement/` but those under
    /// `keep` (the shards of the round a seal replaces, which members that saw its header
    /// may still be reading) and under `own` (the seal's own): what a seal deletes.
    pub fn stale_placements(&self, keep: Option<&str>, own: Option<&str>) -> Vec<(String, String)> {
        let all = self.placements();
        let mut spared: Vec<String> = [keep, own]
            .into_iter()
            .flatten()
            .map(|tag| self.placement_of(tag))
            .collect();
        spared.sort();
        spared.dedup();
        let mut out = Vec::new();
        let mut from = all.clone();
        for under in spared {
            if from < under {
                out.push((from, under.clone()));
            }
            from = past(&under);
        }
        out.push((from, past(&all)));
        out
    }

    /// The key of an `R` whose tail is `tail` (what it names, [`Record::tail`]); with an
    /// empty tail, an `R` of a fixed place, or the prefix of every `R`.
    pub fn key<R: Record>(&self, tail: &str) -> String {
        self.place(R::PLACE, tail)
    }

    /// The key `record` is written at.
    pub fn of<R: Record>(&self, record: &R) -> String {
        self.key::<R>(&record.tail())
    }

    /// The key at `tail` of `place`.
    pub fn place(&self, place: Place, tail: &str) -> String {
        format!("{}{}{tail}", self.root, place.path())
    }
}

/// The key just after every key under the prefix `p`, which ends in '/' ('/' + 1 is '0').
pub(crate) fn past(p: &str) -> String {
    format!("{}0", p.trim_end_matches('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout() {
        use fsdp_proto::v1;
        let k = Keys::new("/fsdp/", "job42").unwrap();
        assert_eq!(k.key::<v1::Member>("n1"), "/fsdp/job42/members/n1");
        assert_eq!(k.key::<v1::Round>(""), "/fsdp/job42/ctl/round");
        let failure = v1::Failure {
            round: 7,
            ..Default::default()
        };
        assert_eq!(
            k.of(&failure),
            "/fsdp/job42/ctl/failures/00000000000000000007"
        );
        assert!(k.of(&failure).starts_with(&k.key::<v1::Failure>("")));
        let fault = v1::Fault {
            round: 7,
            node_id: "n1".into(),
            ..Default::default()
        };
        assert_eq!(
            k.of(&fault),
            "/fsdp/job42/ctl/faults/00000000000000000007/n1"
        );
        assert!(k.of(&fault).starts_with(&k.ctl()));
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
        assert!(Keys::new("/fsdp", "placement").is_err());
        assert!(Keys::new("/fsdp/placement", "x").is_err());
        assert_eq!(Keys::new("/", "j").unwrap().root(), "/j/");
        assert_eq!(Keys::new("", "j").unwrap().root(), "/j/");
        assert_eq!(Keys::new("/team/a/", "j").unwrap().root(), "/team/a/j/");
    }

    #[test]
    fn foreign_ranges_hold_every_nested_run_and_none_of_the_runs_own_keys() {
        use fsdp_proto::v1;
        let k = Keys::new("/fsdp", "train").unwrap();
        let ranges = k.foreign_ranges();
        let inside = |key: &str| {
            ranges
                .iter()
                .filter(|(from, to)| from.as_str() <= key && key < to.as_str())
                .count()
        };
        for own in [
            k.key::<v1::Member>("n1"),
            k.key::<v1::Member>(""),
            k.key::<v1::Round>(""),
            k.key::<v1::Roster>(""),
            k.placement("00000000000000000007.00000000000000ab.1", 0),
            k.placement("00000000000000000007.00000000000000ab.1", 99),
            k.key::<v1::Failure>("00000000000000000007"),
            k.ctl(),
            k.admission(0),
            k.admission(200),
        ] {
            assert_eq!(inside(&own), 0, "{own}");
        }
        for nested in [
            "/fsdp/train/x/members/n1",
            "/fsdp/train/a/b/ctl/round",
            "/fsdp/train/roster/members/n1",
            "/fsdp/train/members0/ctl/round",
            "/fsdp/train/placement0/ctl/round",
            "/fsdp/train/placemenz/members/n",
            "/fsdp/train/ctl0/members/n",
            "/fsdp/train/zz/ctl/halt",
            "/fsdp/train/0/members/n",
        ] {
            assert!(k.nested_run_key(nested), "{nested}");
            assert_eq!(inside(nested), 1, "{nested}");
        }
        assert_eq!(inside("/fsdp/train0"), 0, "the root's end is its own");
        assert_eq!(inside("/fsdp/other/x/members/n"), 0);
    }

    /// A seal deletes every shard but its own and those of the round it replaces, in
    /// ranges that hold nothing else of the run's.
    #[test]
    fn stale_placements_hold_every_other_shard_and_nothing_else() {
        use crate::etcd::placement::tag;
        use fsdp_proto::v1;
        let k = Keys::new("/fsdp", "train").unwrap();
        let (older, keep, lost, own) = (tag(3, 9, 0), tag(5, 9, 1), tag(6, 9, 2), tag(6, 9, 3));
        let inside = |ranges: &[(String, String)], key: &str| {
            ranges
                .iter()
                .any(|(from, to)| from.as_str() <= key && key < to.as_str())
        };
        let ranges = k.stale_placements(Some(&keep), Some(&own));
        for stale in [
            k.placement(&older, 0),
            k.placement(&lost, 7),
            k.placement(&tag(7, 1, 0), 0),
            format!("{}00003", k.placements()),
        ] {
            assert!(inside(&ranges, &stale), "{stale}");
        }
        for kept in [
            k.placement(&keep, 0),
            k.placement(&keep, 99_999),
            k.placement(&own, 0),
            k.placement(&own, 12),
            k.key::<v1::Round>(""),
            k.key::<v1::Roster>(""),
            k.key::<v1::Member>("n"),
            "/fsdp/train0".into(),
        ] {
            assert!(!inside(&ranges, &kept), "{kept}");
        }
        let all = k.stale_placements(None, None);
        assert!(inside(&all, &k.placement(&own, 0)));
        assert!(!inside(&all, &k.key::<v1::Roster>("")));
        // Whatever their order, and the same one twice: both spared, the rest not.
        for ranges in [
            k.stale_placements(Some(&own), Some(&keep)),
            k.stale_placements(Some(&own), Some(&own)),
        ] {
            assert!(!inside(&ranges, &k.placement(&own, 3)));
            assert!(inside(&ranges, &k.placement(&lost, 3)));
        }
        assert!(!inside(
            &k.stale_placements(Some(&own), Some(&keep)),
            &k.placement(&keep, 3)
        ));
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
