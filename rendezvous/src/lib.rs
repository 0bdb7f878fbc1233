//! Rendezvous: how the agents of one job agree on a group, and what each of them learns.
//!
//! # Tour
//!
//! * [`Rendezvous`] is the one interface the agent drives. Every backend answers the same
//!   three questions: "what is the next round?" ([`Rendezvous::next_round`]), "is my round
//!   still the group's round?" ([`Rendezvous::changed`]) and "charge a failure restart to the
//!   job" ([`Rendezvous::record_failure`]). The agent has one code path for all of them.
//! * [`JobRecords`] is the optional capability of a backend that shares records with the
//!   other nodes (etcd): fault order, quarantines, halts, hang reports, how a loss was
//!   noticed. The agent reaches it through [`Rendezvous::records`]; the fixed backends
//!   answer `None` with [`NoRecords`], a type with no values, so no no-op stands in for a
//!   record that does not exist.
//! * [`Round`] is what a node learns when a round is sealed: its group rank, the global rank
//!   of its first worker, the world size, the master address and port, and the job-wide
//!   restart count.
//! * [`ranks`] computes ranks from an ordered member list as a pure function, so every
//!   backend (and every node) derives the same ranks from the same record. The etcd
//!   coordinator orders that list by where nodes sit ([`topology`]): nodes of one rack or
//!   zone get contiguous ranks.
//! * Backends: [`standalone::StandaloneRendezvous`] (one node, in-process, no external
//!   service) and [`static_group::StaticRendezvous`] (a fixed set of nodes whose ranks and
//!   master are given on the command line, Kubeflow's non-elastic master mode) share one
//!   body, [`fixed::Fixed`], and share no records; a static group's agents meet once, at
//!   node 0's [`static_gate`], so that no worker starts before every node is there. The
//!   etcd v3 backend implements both traits; a node waiting in it says what it waits for
//!   ([`etcd::waiting`]).
//! * [`fence`] decides when an agent cut off from etcd stops its own workers (before its
//!   lease can expire), from the pure [`fence::LeaseClock`].

pub mod backoff;
pub mod error;
pub mod etcd;
pub mod fence;
pub mod fixed;
mod host;
pub mod job;
pub mod lacking;
pub mod pace;
pub mod port;
pub mod ranks;
pub mod seal;
// The deterministic simulator: test-only, with the `sim` feature (docs/simulation.md).
#[cfg(feature = "sim")]
#[doc(hidden)]
pub mod sim;
pub mod standalone;
pub mod static_gate;
pub mod static_group;
#[doc(hidden)]
pub mod switches;
pub mod text;
pub mod topology;

pub use error::RendezvousError;
pub use host::hostname;

/// What a node knows about the group once a round is sealed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Round {
    /// The round number, increasing by one each time the group re-forms.
    pub number: u64,
    /// This node's rank among the nodes (`GROUP_RANK`).
    pub group_rank: u32,
    /// Number of nodes in the round (`GROUP_WORLD_SIZE`).
    pub group_world_size: u32,
    /// Global rank of this node's local rank 0; worker `i` gets `base_rank + i`.
    pub base_rank: u32,
    /// Total number of workers over all nodes (`WORLD_SIZE`).
    pub world_size: u32,
    /// Where worker rank 0 hosts the c10d store (`MASTER_ADDR`).
    pub master_addr: String,
    /// Port of that store (`MASTER_PORT`), published fresh every round.
    pub master_port: u16,
    /// Failure restarts used so far by the whole job (`TORCHELASTIC_RESTART_COUNT`).
    pub restart_count: u32,
    /// Every node of the round in group-rank order (for status; ranks as [`ranks::assign`]).
    /// Shared, not copied: at 1,000 nodes each copy of the list is thousands of
    /// allocations, and the agent keeps the round in its status, its memory of the last
    /// round and its report.
    pub members: std::sync::Arc<[RoundMember]>,
    /// Why the round was sealed, in words (for status and logs).
    pub reason: String,
    /// When each charged failure restart was charged (Unix ms), oldest first; at most the
    /// last [`CHARGES_KEPT`]. Backends that keep no times leave it empty.
    pub charged_at_ms: Vec<u64>,
    /// When the round was sealed (Unix ms): the end of a restart window, the same for
    /// every node.
    pub sealed_at_ms: u64,
    /// Sealed with this node in it, but broken before it started (a member left): only
    /// its restart count is read (every node decides the budget alike from a sealed
    /// round, also one it never ran), then the next round is asked for. `None` for a
    /// round to run.
    pub broken: Option<Change>,
}

/// What a backend counts for the agent's metrics, and what its status service says of
/// it; shared with its tasks.
#[derive(Debug, Clone, Default)]
pub struct Counters {
    /// The lease this node's registration lives on now (0 before the first): the
    /// liveness heartbeats announce it as soon as it changes, so that the ring watcher
    /// revokes the lease the dead agent really held, not the one a round recorded before
    /// the store lost it.
    pub lease: std::sync::Arc<tokio::sync::watch::Sender<i64>>,
    /// Errors it recovered from by itself (lost etcd connections, failed keep-alives).
    pub errors: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Rounds this agent sealed as the coordinator.
    pub rounds_sealed: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Times the coordinator held a round back because rounds came too fast ([`pace`]).
    pub seals_held: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// CPU time (ns, this thread's) spent deciding as the coordinator: every look at the
    /// registrations, and building each round it sealed. `rdzv-bench` prints it and the
    /// seal's part (below) at each group size: the seal's must grow only linearly with the
    /// group, or sealing a round of thousands of nodes stalls the coordinator.
    pub coordinating_ns: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// The part of `coordinating_ns` spent in the decisions that sealed a round.
    pub sealing_ns: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Times this node found its lease gone in etcd (a keep-alive or a request answered
    /// "lease not found"): in a crowd, each is a registration lost and written again.
    pub leases_lost: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Registrations written on a lease other than the one the last was written on:
    /// writes a crowd adds while etcd is behind (`rdzv-bench` prints both).
    pub reregistered: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Time (ns) this node's requests were held by its pace while it formed
    /// (`admission`: after a slow answer, a late keep-alive, or a refusal beyond the
    /// backoff every request waits; the join's first spread is not counted): whether the
    /// pace is what held a crowd's slowest nodes (`rdzv-bench` prints the longest, and the
    /// slowest node's).
    pub paced_ns: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Time (ns) this node was held at the gate before its grant while etcd answered
    /// slowly (`admission::Gate`), after its turn.
    pub gated_ns: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// 1 if this node, held at the gate, went on at the coordinator's push before its
    /// pause was over (`rdzv-bench` prints how many nodes).
    pub gate_pushed: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Looks this node made waiting its turn in a crowd (`session::Turn`: a read of the
    /// admission keys and a watch of them, made again after a failure): `rdzv-bench`
    /// prints them a node.
    pub turn_looks: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// 1 if this node's turn came by the coordinator's push, not at its latest moment
    /// (`rdzv-bench` prints how many nodes).
    pub turn_pushed: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Time (ns) this node waited its turn after its first look (`rdzv-bench` prints the
    /// longest).
    pub turn_ns: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Admission keys written as the coordinator of a forming crowd (`session::Turn`):
    /// at most one per key, apart from the node's own writes as the shards are.
    pub admission_keys: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Transactions that wrote a placed round's shards ahead of its header, as the
    /// coordinator (a round of 10,000 takes 6): apart from a node's own writes, whose
    /// count is bounded at formation whatever the crowd, while these grow with it.
    pub shard_txns: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

/// Charged restarts whose times a round keeps.
pub const CHARGES_KEPT: usize = 1000;

/// Now, in Unix milliseconds.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// One node of a sealed round.
///
/// It holds the round record's member itself, shared: every agent builds its round from
/// the record at every re-form, and copying each member's names was thousands of
/// allocations per agent at 1,000 members.
#[derive(Clone)]
pub struct RoundMember {
    record: fsdp_proto::v1::Member,
    pub group_rank: u32,
    /// Global rank of the node's local rank 0.
    pub base_rank: u32,
}

impl Round {
    /// The round as the node at index `me` of `members` sees it. `members` are in rank
    /// order; their ranks are (re)assigned here by [`ranks::assign`], so every backend and
    /// every node derives the same ranks from the same list. Fails when the worker counts
    /// cannot form a group, or `me` is not a member.
    pub fn new(
        number: u64,
        mut members: Vec<RoundMember>,
        me: usize,
        master: (String, u16),
        restart_count: u32,
        reason: String,
    ) -> Result<Self, String> {
        let world_size = ranks::rank_members(&mut members)?;
        Self::of_ranked(
            number,
            members.into(),
            world_size,
            me,
            master,
            restart_count,
            reason,
        )
    }

    /// As [`Round::new`], from members already given their ranks by
    /// [`ranks::rank_members`] (which returned `world_size`): the nodes of one process share
    /// one ranked list of a round ([`crate::etcd`]'s memo).
    pub(crate) fn of_ranked(
        number: u64,
        members: std::sync::Arc<[RoundMember]>,
        world_size: u32,
        me: usize,
        master: (String, u16),
        restart_count: u32,
        reason: String,
    ) -> Result<Self, String> {
        let mine = members.get(me).ok_or_else(|| {
            format!(
                "node index {me} is outside the round's {} nodes",
                members.len()
            )
        })?;
        Ok(Self {
            number,
            group_rank: mine.group_rank,
            group_world_size: members.len() as u32,
            base_rank: mine.base_rank,
            world_size,
            master_addr: master.0,
            master_port: master.1,
            restart_count,
            members,
            reason,
            charged_at_ms: Vec::new(),
            sealed_at_ms: unix_ms(),
            broken: None,
        })
    }
}

impl RoundMember {
    /// A member of a placed round, at the ranks its place gives it.
    pub(crate) fn placed(m: &fsdp_proto::v1::Member, group_rank: u32, base_rank: u32) -> Self {
        Self {
            record: m.clone(),
            group_rank,
            base_rank,
        }
    }

    /// A node of a round before [`Round::new`] or [`ranks::rank_members`] gives it ranks.
    pub fn unranked(node_id: String, addr: String, local_world_size: u32) -> Self {
        let fields = fsdp_proto::v1::MemberFields {
            node_id,
            addr,
            local_world_size,
            ..Default::default()
        };
        Self {
            record: fields.into(),
            group_rank: 0,
            base_rank: 0,
        }
    }

    /// The node's id, unique per agent process.
    pub fn node_id(&self) -> &str {
        &self.record.node_id
    }

    /// The address the node advertises.
    pub fn addr(&self) -> &str {
        &self.record.addr
    }

    /// Where the node's status server listens (empty if it has none).
    pub fn status_addr(&self) -> &str {
        &self.record.status_addr
    }

    /// Workers the node runs.
    pub fn local_world_size(&self) -> u32 {
        self.record.local_world_size
    }
}

impl From<&fsdp_proto::v1::Member> for RoundMember {
    fn from(m: &fsdp_proto::v1::Member) -> Self {
        Self {
            record: m.clone(),
            group_rank: 0,
            base_rank: 0,
        }
    }
}

/// Members are the same node at the same ranks: what else their records say (what the
/// node asked for, its lease) is not part of the round it runs.
impl PartialEq for RoundMember {
    fn eq(&self, other: &Self) -> bool {
        (self.node_id(), self.addr(), self.local_world_size())
            == (other.node_id(), other.addr(), other.local_world_size())
            && (self.group_rank, self.base_rank) == (other.group_rank, other.base_rank)
    }
}

impl Eq for RoundMember {}

impl std::fmt::Debug for RoundMember {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoundMember")
            .field("node_id", &self.node_id())
            .field("addr", &self.addr())
            .field("group_rank", &self.group_rank)
            .field("base_rank", &self.base_rank)
            .field("local_world_size", &self.local_world_size())
            .finish()
    }
}

/// Why the agent's current round stopped being the group's round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// A member left or was evicted; the group must re-form without it.
    MemberLost { node: String },
    /// A node is waiting and the group can grow; re-form to admit it.
    NodeWaiting { waiting: u32 },
    /// Another node charged a failure restart; every node restarts its workers.
    PeerFailed { restart_count: u32 },
    /// The coordinator sealed a newer round (e.g. to admit a waiting node).
    NewRound { number: u64 },
    /// This node could not renew its lease and fences itself: its workers stop before
    /// etcd can expire the lease and the others re-form without it ([`fence`]).
    /// `stop_within` is how long the workers may take to stop (their SIGTERM grace is cut
    /// to fit).
    Fenced {
        reason: String,
        stop_within: std::time::Duration,
    },
    /// A node ended the run for everyone ([`JobRecords::halt`]).
    Halted(Halt),
}

/// In words, for log lines and the status board.
impl std::fmt::Display for Change {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Change::MemberLost { node } => write!(f, "node {node} left the group"),
            Change::NodeWaiting { waiting } => write!(f, "{waiting} node(s) waiting to join"),
            // The count it carries is the charging node's; the next round says the one
            // every node agrees on.
            Change::PeerFailed { .. } => write!(f, "another node's worker failed"),
            Change::NewRound { number } => write!(f, "round {number} was sealed"),
            Change::Fenced { reason, .. } => write!(f, "this node fenced itself: {reason}"),
            Change::Halted(h) => write!(f, "{h}"),
        }
    }
}

/// A node's decision that the run is over for every node, with the code they exit with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Halt {
    pub node_id: String,
    pub exit_code: u8,
    pub reason: String,
}

impl std::fmt::Display for Halt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "node {} ended the run with exit code {}: {}",
            self.node_id, self.exit_code, self.reason
        )
    }
}

/// How the loss of a member was noticed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detection {
    /// It left: it revoked its own lease (SIGTERM, a pod delete).
    Left,
    /// Its status port refused a connection: its process was gone. `detect` runs from its
    /// liveness stream breaking to that proof.
    Refused { detect: std::time::Duration },
    /// It went silent and its lease expired.
    LeaseExpiry,
    /// Nobody said how: it went from a round another member's departure had broken
    /// already, where a word is no news to the members (a run leaving at once).
    Unsaid,
}

impl Detection {
    /// The label status and metrics use.
    pub fn label(self) -> &'static str {
        match self {
            Self::Left => "left",
            Self::Refused { .. } => "refused",
            Self::LeaseExpiry => "lease expiry",
            Self::Unsaid => "unsaid",
        }
    }
}

/// Where one node's ranks were when a hang was declared in a round (see
/// [`JobRecords::report_hang`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct HangReport {
    pub node_id: String,
    /// This node found the group hung; the others report because it did.
    pub declared: bool,
    /// The declaring node's reason; empty for the others.
    pub reason: String,
    pub ranks: Vec<RankStep>,
}

/// One reporting rank's progress in a hung round.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RankStep {
    pub rank: u32,
    /// The last step it finished; `None` before its first.
    pub last_step: Option<u64>,
    /// The phase it was in, if any.
    pub phase: Option<String>,
}

/// The outcome of the exit barrier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    /// Every member of the round finished: the job is done.
    AllDone,
    /// The group broke before everyone finished.
    Changed(Change),
    /// Some members had not finished when the wait ran out.
    TimedOut { unfinished: Vec<String> },
}

/// How this node ends its part in the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Departure {
    /// Every local worker succeeded.
    Finished,
    /// The restart budget is spent.
    Failed,
    /// The agent was told to stop (a signal, a pod delete); the run goes on without it.
    Left,
}

/// Why a node left the run or its group, as `fsdp-agent status` shows it (the record
/// `ctl/left/`, [`etcd::record`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeftKind {
    /// Every worker of the node exited 0.
    Finished,
    /// A signal stopped the agent; the run goes on without it.
    Left,
    /// Its health check failed every try.
    Unhealthy,
    /// Its machine was quarantined.
    Quarantined,
    /// The run ended for every node.
    Halted,
    /// The restart budget was spent, the exit barrier ran out, or no round formed
    /// within the join timeout.
    Failed,
    /// It could not renew its lease and stopped its own workers.
    Fenced,
    /// Its registration vanished without a word (the coordinator says so).
    Lost,
}

impl LeftKind {
    /// The word status shows.
    pub fn label(self) -> &'static str {
        match self {
            Self::Finished => "finished",
            Self::Left => "left",
            Self::Unhealthy => "unhealthy",
            Self::Quarantined => "quarantined",
            Self::Halted => "halted",
            Self::Failed => "failed",
            Self::Fenced => "fenced",
            Self::Lost => "lost",
        }
    }
}

/// Why this node leaves: its kind and one line of detail (the health check's message, the
/// signal, the exit code).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeftReason {
    pub kind: LeftKind,
    pub detail: String,
}

impl LeftReason {
    pub fn new(kind: LeftKind, detail: impl Into<String>) -> Self {
        Self {
            kind,
            detail: detail.into(),
        }
    }
}

/// The interface every rendezvous backend implements/// The interface every rendezvous backend implements: the questions every backend answers
/// the same way, whatever it shares with other nodes.
///
/// The agent's runtime is single-threaded (see the agent crate's docs for why), so the
/// futures need not be `Send`.
#[expect(
    async_fn_in_trait,
    reason = "driven through generics on the agent's single-threaded runtime; no Send bound is needed"
)]
pub trait Rendezvous {
    /// The job records this backend shares with the other nodes ([`NoRecords`] for a backend
    /// that shares none).
    type Records: JobRecords;

    /// The backend's name as the configuration printer and logs show it.
    fn backend(&self) -> &'static str;

    /// The run id that scopes this rendezvous (`TORCHELASTIC_RUN_ID`).
    fn run_id(&self) -> &str;

    /// This node's id in the group, when the backend names nodes.
    fn node_id(&self) -> Option<&str> {
        None
    }

    /// The job records shared with the other nodes, when the backend keeps any: the
    /// code paths that need them (quarantine, halts, hang reports) ask here once, and a
    /// fixed backend's `None` says that they have nothing to do.
    fn records(&mut self) -> Option<&mut Self::Records>;

    /// Joins the next round and waits until it is sealed.
    async fn next_round(&mut self) -> Result<Round, RendezvousError>;

    /// Resolves when the round returned by the last [`Rendezvous::next_round`] is no longer
    /// the group's round. Single-node backends never resolve.
    async fn changed(&mut self) -> Result<Change, RendezvousError>;

    /// Charges one failure restart to the job-wide budget and returns the restarts used.
    async fn record_failure(&mut self) -> Result<u32, RendezvousError>;

    /// Tells the group this node's workers all succeeded in the current round and waits,
    /// at most `timeout`, until every member of the round has finished too. Returns early
    /// with the change if the group breaks meanwhile (the survivors then re-form).
    async fn finish(&mut self, timeout: std::time::Duration) -> Result<Finish, RendezvousError>;

    /// Ends this node's part in the run, saying `why` to the backend's records (status
    /// shows it after the node is gone). Never closes the run for the other nodes.
    async fn depart(&mut self, how: Departure, why: LeftReason) -> Result<(), RendezvousError>;
}

/// What a backend shares with the other nodes of the job beyond the round itself: who
/// seals, how losses were noticed, faults and their order, quarantines, health, halts
/// and hang reports. Only a backend with shared state (etcd, or the c10d store that
/// speaks its API) has them; reached through [`Rendezvous::records`].
#[expect(
    async_fn_in_trait,
    reason = "driven through generics on the agent's single-threaded runtime; no Send bound is needed"
)]
pub trait JobRecords {
    /// The node that seals rounds right now.
    fn coordinator(&self) -> Option<String>;

    /// Where the backend counts what the agent's metrics export (errors it recovered from
    /// by itself, rounds it sealed).
    fn counters(&self) -> Counters;

    /// How the loss of `node` from round `round` was noticed.
    fn detection(&self, node: &str, round: u64) -> Detection;

    /// A worker of this node failed in the current round (`exit`, in words), seen at
    /// `exited_ms` (Unix ms). Called the moment the agent sees it, before it stops
    /// anything: the reports tell whose failure came first ([`JobRecords::first_fault`]).
    async fn report_fault(&mut self, exit: String, exited_ms: u64) -> Result<(), RendezvousError>;

    /// The node whose worker failed first in `round`, if any did: the earliest exit seen,
    /// then the first report.
    fn first_fault(&self, round: u64) -> Option<String>;

    /// Keeps `machine` out of the run until `until_ms` (Unix ms), for `reason`; `node` is
    /// the node it takes out (`None`: this one).
    async fn quarantine(
        &mut self,
        machine: String,
        node: Option<String>,
        reason: String,
        until_ms: u64,
    ) -> Result<(), RendezvousError>;

    /// Whether `machine` is kept out of the run now: why, and until when (Unix ms).
    fn quarantined(&self, machine: &str) -> Option<(String, u64)>;

    /// The node a standing quarantine of `machine` took out (a running node leaves only
    /// for one that names it: agents of other runs' nodes may share its machine).
    fn quarantined_node(&self, machine: &str) -> Option<String>;

    /// Every standing quarantine's reason and end (Unix ms).
    fn quarantines(&self) -> Vec<(String, u64)>;

    /// This node's health check failed (`failures` times in a row, the last for `reason`):
    /// it stays out of rounds, and says why, until it joins again.
    async fn unhealthy(&mut self, reason: String, failures: u32) -> Result<(), RendezvousError>;

    /// Ends the run for every node: each exits with `exit_code` (a failure no restart can
    /// mend).
    async fn halt(&mut self, exit_code: u8, reason: String) -> Result<(), RendezvousError>;

    /// Publishes where this node's ranks were in `round`, which hung (one small record per
    /// node, only on a hang).
    async fn report_hang(&mut self, round: u64, report: HangReport) -> Result<(), RendezvousError>;

    /// The hang reports of `round` published so far, waiting at most `patience` for one
    /// from every node in `want`.
    async fn hang_reports(
        &mut self,
        round: u64,
        want: &[String],
        patience: std::time::Duration,
    ) -> Vec<HangReport>;
}

/// The records of a backend that shares none: it has no value, so a `None` from
/// [`Rendezvous::records`] is the only answer and the methods below can never run.
#[derive(Debug)]
pub enum NoRecords {}

impl JobRecords for NoRecords {
    fn coordinator(&self) -> Option<String> {
        match *self {}
    }

    fn counters(&self) -> Counters {
        match *self {}
    }

    fn detection(&self, _node: &str, _round: u64) -> Detection {
        match *self {}
    }

    async fn report_fault(&mut self, _exit: String, _at: u64) -> Result<(), RendezvousError> {
        match *self {}
    }

    fn first_fault(&self, _round: u64) -> Option<String> {
        match *self {}
    }

    async fn quarantine(
        &mut self,
        _machine: String,
        _node: Option<String>,
        _reason: String,
        _until_ms: u64,
    ) -> Result<(), RendezvousError> {
        match *self {}
    }

    fn quarantined(&self, _machine: &str) -> Option<(String, u64)> {
        match *self {}
    }

    fn quarantined_node(&self, _machine: &str) -> Option<String> {
        match *self {}
    }

    fn quarantines(&self) -> Vec<(String, u64)> {
        match *self {}
    }

    async fn unhealthy(&mut self, _reason: String, _failures: u32) -> Result<(), RendezvousError> {
        match *self {}
    }

    async fn halt(&mut self, _exit_code: u8, _reason: String) -> Result<(), RendezvousError> {
        match *self {}
    }

    async fn report_hang(
        &mut self,
        _round: u64,
        _report: HangReport,
    ) -> Result<(), RendezvousError> {
        match *self {}
    }

    async fn hang_reports(
        &mut self,
        _round: u64,
        _want: &[String],
        _patience: std::time::Duration,
    ) -> Vec<HangReport> {
        match *self {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_ranks_its_members_in_order_and_takes_this_nodes_place() {
        let members = [("a", 8), ("b", 1), ("c", 4)]
            .map(|(id, n)| RoundMember::unranked(id.into(), format!("{id}.local"), n));
        let r = Round::new(
            2,
            members.to_vec(),
            2,
            ("a.local".into(), 29500),
            1,
            "why".into(),
        )
        .unwrap();
        assert_eq!((r.group_rank, r.base_rank), (2, 9));
        assert_eq!((r.group_world_size, r.world_size), (3, 13));
        let bases: Vec<u32> = r.members.iter().map(|m| m.base_rank).collect();
        assert_eq!(bases, [0, 8, 9]);
        let outside = Round::new(2, members.to_vec(), 3, ("a".into(), 1), 0, String::new());
        assert!(outside.is_err());
    }
}
