//! What this node accepts from the records others write: its own rules. A record that no
//! agent of this run could have written (a halt with exit code 0, a node asking for more
//! workers than this run gives a node, a round larger than `--nnodes` allows) is refused
//! whoever wrote it: logged once with its key and ignored, never obeyed.

use std::collections::BTreeSet;
use std::ops::RangeInclusive;
use std::time::Duration;

use fsdp_proto::v1;

use crate::ranks;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allowed {
    /// Nodes a round may have (`--nnodes`).
    pub nodes: RangeInclusive<u32>,
    /// Workers a node may ask for (`--nproc-per-node` when it is a number: every node of a
    /// run is given the same; any sane count when nodes count their own GPUs).
    pub workers_per_node: RangeInclusive<u32>,
    /// Exit codes a halt may end the run with: those this node's own failure policy
    /// writes (`--no-retry-exit-codes`, the no-progress rule's); `None`: any but 0.
    pub halt_codes: Option<BTreeSet<u8>>,
    /// How long this node's own policy keeps a machine out (`--quarantine-for`); `None`
    /// when it never quarantines (`--quarantine-after 0`, no `--quarantine-on-exit`,
    /// `--straggler-policy warn`), and then it obeys no quarantine either.
    pub quarantine_for: Option<Duration>,
}

/// How far another node's clock may run ahead of this one's in a quarantine's end.
const CLOCK_SLACK: Duration = Duration::from_secs(60);

/// `--quarantine-for`'s default: what a reader that knows no flags (status) accepts.
const DEFAULT_QUARANTINE_FOR: Duration = Duration::from_secs(3600);

impl Default for Allowed {
    fn default() -> Self {
        Self {
            nodes: 1..=u32::MAX,
            workers_per_node: 1..=ranks::MAX_LOCAL_WORLD_SIZE,
            halt_codes: None,
            quarantine_for: Some(DEFAULT_QUARANTINE_FOR),
        }
    }
}

impl Allowed {
    /// A halt ends every agent with its code: 0 would report a killed run as a success.
    pub fn halt(&self, h: &v1::Halt) -> Result<(), String> {
        if h.exit_code == 0 {
            return Err(
                "has exit code 0: a halt ends a run that failed, never with success".into(),
            );
        }
        match &self.halt_codes {
            Some(codes) if !u8::try_from(h.exit_code).is_ok_and(|c| codes.contains(&c)) => {
                Err(format!(
                    "has exit code {}, which this node's failure policy never writes (it halts with {})",
                    h.exit_code,
                    list(codes)
                ))
            }
            _ => Ok(()),
        }
    }

    /// A quarantine is obeyed only as this node's own policy would write it: one that
    /// keeps a machine out for longer than `--quarantine-for` from `now_ms` (with a minute
    /// for the writer's clock) is a forgery that would keep it out for ever.
    pub fn quarantine(&self, q: &v1::Quarantine, now_ms: u64) -> Result<(), String> {
        let Some(bound) = self.quarantine_for else {
            return Err(
                "is not obeyed: this node's failure policy never quarantines (--quarantine-after 0, no --quarantine-on-exit, --straggler-policy warn)"
                    .into(),
            );
        };
        let latest = now_ms
            .saturating_add(u64::try_from((bound + CLOCK_SLACK).as_millis()).unwrap_or(u64::MAX));
        if q.until_ms > latest {
            // No "from now" in the reason: it is logged once per reason, and a reason that
            // changed each second would be logged again at every read of the store.
            return Err(format!(
                "keeps the machine out until unix time {} s, longer than --quarantine-for ({} s) allows",
                q.until_ms / 1000,
                bound.as_secs()
            ));
        }
        Ok(())
    }

    /// A node's worker count.
    pub fn workers(&self, local_world_size: u32) -> Result<(), String> {
        if self.workers_per_node.contains(&local_world_size) {
            return Ok(());
        }
        Err(format!(
            "has local_world_size {local_world_size}, outside {}..={} (this run's workers per node)",
            self.workers_per_node.start(),
            self.workers_per_node.end()
        ))
    }

    /// A round's size, and each member's worker count.
    pub fn round(&self, r: &v1::Round) -> Result<(), String> {
        self.group_of(u32::try_from(r.members.len()).unwrap_or(u32::MAX))?;
        for m in &r.members {
            self.workers(m.local_world_size)
                .map_err(|why| format!("gives node {} a count that {why}", m.node_id))?;
        }
        Ok(())
    }

    /// A member's copy of a placed round (or its header alone, for a node sealed without
    /// it): the sizes the header says, and the member's place within them. The rest of
    /// the group is the coordinator's word: nobody but it reads the whole.
    pub fn placed(&self, r: &v1::Round) -> Result<(), String> {
        self.group_of(r.group_world_size)?;
        if r.world_size > crate::ranks::MAX_WORLD_SIZE {
            return Err(format!(
                "has {} workers, more than {}",
                r.world_size,
                crate::ranks::MAX_WORLD_SIZE
            ));
        }
        for m in &r.members {
            self.workers(m.local_world_size)
                .map_err(|why| format!("gives node {} a count that {why}", m.node_id))?;
        }
        if let Some(p) = &r.placed {
            let workers = p.member.as_ref().map_or(0, |m| m.local_world_size);
            let fits = u64::from(p.base_rank) + u64::from(workers) <= u64::from(r.world_size);
            if p.group_rank >= r.group_world_size || !fits {
                return Err(format!(
                    "places a node at rank {} (workers from {}), outside its group of {} nodes \
                     and {} workers",
                    p.group_rank, p.base_rank, r.group_world_size, r.world_size
                ));
            }
        }
        Ok(())
    }

    /// A group of `n` nodes, within this run's `--nnodes`.
    fn group_of(&self, n: u32) -> Result<(), String> {
        if !self.nodes.contains(&n) {
            return Err(format!(
                "has {n} nodes, outside {}..={} (this run's --nnodes)",
                self.nodes.start(),
                self.nodes.end()
            ));
        }
        Ok(())
    }
}

/// The longest detail an agent writes in a `left` record (it cuts its own to fit): a
/// line of text, as every reason a record carries.
pub const LEFT_DETAIL_MAX: usize = crate::text::LINE_MAX;

/// `detail` cut to [`LEFT_DETAIL_MAX`] characters, on one line, with no control character.
pub fn left_detail(detail: &str) -> String {
    crate::text::one_line(detail, LEFT_DETAIL_MAX)
}

impl Allowed {
    /// A departure record says why a node left, nothing more: one that no agent writes
    /// (no kind, no node) is refused; its text is judged with every record's
    /// (`Record::allowed`). Trusted ones change nothing the group does either; status
    /// shows them.
    pub fn left(&self, l: &v1::Left) -> Result<(), String> {
        if !matches!(v1::LeftKind::try_from(l.kind), Ok(k) if k != v1::LeftKind::Unspecified) {
            return Err(format!("has kind {}, which no agent writes", l.kind));
        }
        if l.node_id.is_empty() {
            return Err("names no node".into());
        }
        Ok(())
    }
}

fn list(codes: &BTreeSet<u8>) -> String {
    if codes.is_empty() {
        return "none".into();
    }
    let v: Vec<String> = codes.iter().map(u8::to_string).collect();
    v.join(", ")
}
