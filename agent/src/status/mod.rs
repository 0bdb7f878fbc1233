//! What the agent tells the outside world: a [`Board`] the agent loop writes at every
//! transition, read by the status server ([`server`]: gRPC status, `grpc.health.v1`,
//! Prometheus `/metrics` on one port) and rendered as text by [`metrics`]. The
//! `fsdp-agent status` command ([`command`]) reads a whole run from etcd instead.

pub mod command;
pub mod limits;
pub mod metrics;
pub mod server;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fsdp_proto::v1::{AgentState, Phase, RoundMember, Transition, Worker, WorkerState};
use fsdp_rendezvous::Round;
use tokio::sync::watch;

use crate::failure::WorkerExit;
use crate::supervisor::WorkerStatus;

/// Running totals behind a Prometheus summary: the last value, the sum and the count.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timing {
    pub last: f64,
    pub sum: f64,
    pub count: u64,
}

impl Timing {
    fn observe(&mut self, d: Duration) {
        self.last = d.as_secs_f64();
        self.sum += self.last;
        self.count += 1;
    }
}

/// Everything the status server shows, as one consistent copy.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// The shown state; its `members` are filled from [`Snapshot::round_members`] only
    /// in the copy [`Board::snapshot`] hands out.
    pub state: AgentState,
    /// The round's members as the rendezvous gave them, shared: copied into the shown
    /// state only when someone asks (a re-form at 1,000 nodes copied them every round).
    pub round_members: Arc<[fsdp_rendezvous::RoundMember]>,
    /// Workers that exited on their own, by exit label ("0", "1", "SIGKILL", ...).
    pub worker_exits: BTreeMap<String, u64>,
    /// Times the group was stopped to re-form or restart, by reason.
    pub reforms: BTreeMap<String, u64>,
    /// Re-forms the workers took in place, by where they restored their state from
    /// ("memory"; "disk": the fallback, a step not whole in peer memory).
    pub in_place: BTreeMap<String, u64>,
    /// This node's group broke → a round sealed without the lost member.
    pub detect: Timing,
    /// This node's group broke → its workers run again in a new round.
    pub reform: Timing,
    /// Rendezvous errors: the backend's recovered ones plus those the agent saw.
    pub rendezvous_errors: u64,
    /// Rounds this agent sealed as the rendezvous coordinator.
    pub rounds_sealed: u64,
    /// Times this agent, as coordinator, held a round back because rounds came too fast.
    pub seals_held: u64,
    /// Members this node's group lost, by how the loss was noticed.
    pub losses: BTreeMap<String, u64>,
    /// Times this node's group was found hung.
    pub hangs: u64,
    /// Failed health checks of this node.
    pub health_failures: u64,
    /// For losses proven by a refused connection: from the liveness stream breaking to
    /// the proof.
    pub refused_detect: Timing,
}

struct Inner {
    snapshot: Mutex<Snapshot>,
    /// The backend's own counts (etcd reconnects, rounds sealed).
    backend: Mutex<Option<fsdp_rendezvous::Counters>>,
    /// Readiness, for the health service to follow.
    ready: watch::Sender<bool>,
}

/// The agent's status, shared between the agent loop and the status server.
#[derive(Clone)]
pub struct Board {
    inner: Arc<Inner>,
}

impl Board {
    pub fn new(run_id: &str, backend: &str, max_restarts: u32) -> Self {
        let state = AgentState {
            run_id: run_id.to_owned(),
            backend: backend.to_owned(),
            phase: Phase::Rendezvous as i32,
            max_restarts,
            restarts_left: max_restarts,
            ..AgentState::default()
        };
        Self {
            inner: Arc::new(Inner {
                snapshot: Mutex::new(Snapshot {
                    state,
                    ..Snapshot::default()
                }),
                backend: Mutex::new(None),
                ready: watch::Sender::new(false),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Snapshot> {
        // A panic while holding the lock leaves plain data behind; keep serving it.
        self.inner
            .snapshot
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// A copy of the current status.
    /// This agent's node id (cheap: a liveness heartbeat asks every second, and a
    /// snapshot copies every member of the round).
    pub fn node_id(&self) -> String {
        self.lock().state.node_id.clone()
    }

    /// Follows the lease this agent's registration lives on (`None` before it joined a
    /// run).
    pub fn lease(&self) -> Option<watch::Receiver<i64>> {
        self.inner
            .backend
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|c| c.lease.subscribe())
    }

    pub fn snapshot(&self) -> Snapshot {
        let mut s = self.lock().clone();
        s.state.members = s
            .round_members
            .iter()
            .map(|m| RoundMember {
                node_id: m.node_id().to_owned(),
                addr: m.addr().to_owned(),
                group_rank: m.group_rank,
                base_rank: m.base_rank,
                local_world_size: m.local_world_size(),
            })
            .collect();
        if let Some(c) = self
            .inner
            .backend
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            s.rendezvous_errors += c.errors.load(Ordering::Relaxed);
            s.rounds_sealed = c.rounds_sealed.load(Ordering::Relaxed);
            s.seals_held = c.seals_held.load(Ordering::Relaxed);
        }
        s
    }

    /// Follows readiness (workers running in a sealed round).
    pub fn ready(&self) -> watch::Receiver<bool> {
        self.inner.ready.subscribe()
    }

    /// Names this node and where its backend counts what the metrics export.
    pub fn set_node(&self, node_id: &str, counters: Option<fsdp_rendezvous::Counters>) {
        self.lock().state.node_id = node_id.to_owned();
        *self.inner.backend.lock().unwrap_or_else(|e| e.into_inner()) = counters;
    }

    /// Moves to `to`, remembering why.
    pub fn transition(&self, to: Phase, reason: impl Into<String>) {
        let ready = to == Phase::Running;
        {
            let mut s = self.lock();
            let from = s.state.phase;
            s.state.phase = to as i32;
            s.state.ready = ready;
            s.state.last_transition = Some(Transition {
                at_unix_ms: SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64),
                from,
                to: to as i32,
                reason: reason.into(),
            });
        }
        // Only real flips: health watchers see one NOT_SERVING per outage.
        self.inner
            .ready
            .send_if_modified(|r| std::mem::replace(r, ready) != ready);
    }

    /// Records a sealed round.
    pub fn round(&self, round: &Round, coordinator: Option<String>) {
        let mut s = self.lock();
        let st = &mut s.state;
        st.round = round.number;
        st.group_rank = round.group_rank;
        st.group_world_size = round.group_world_size;
        st.world_size = round.world_size;
        st.master_addr = round.master_addr.clone();
        st.master_port = u32::from(round.master_port);
        st.restarts_used = round.restart_count;
        st.restarts_left = st.max_restarts.saturating_sub(round.restart_count);
        st.coordinator = coordinator.unwrap_or_default();
        st.workers.clear();
        s.round_members = round.members.clone();
    }

    /// Records the workers' states. `own_exits` counts exits the workers made on their
    /// own (not stops by the agent) into the exit-code metric.
    pub fn workers(&self, workers: &[WorkerStatus], count_exits: bool) {
        let mut s = self.lock();
        s.state.workers = workers.iter().map(worker_record).collect();
        if count_exits {
            for w in workers.iter().filter(|w| !w.stopped_by_agent) {
                if let Some(exit) = w.exit {
                    *s.worker_exits.entry(exit_label(exit)).or_default() += 1;
                }
            }
        }
    }

    /// Counts a stop of the group for a re-form or restart.
    pub fn reform_started(&self, reason: &str) {
        *self.lock().reforms.entry(reason.to_owned()).or_default() += 1;
    }

    pub fn observe_detect(&self, d: Duration) {
        self.lock().detect.observe(d);
    }

    pub fn hung(&self) {
        self.lock().hangs += 1;
    }

    /// The local ranks' progress as last judged (status and the straggler metrics).
    pub fn ranks(&self, ranks: Vec<fsdp_proto::v1::RankStatus>) {
        self.lock().state.ranks = ranks;
    }

    /// The machine this agent runs on (what a quarantine names).
    pub fn machine(&self, machine: &str) {
        self.lock().state.machine = machine.to_owned();
    }

    /// The straggler judge's latest scores (this node judges its group), or none.
    pub fn straggler_scores(&self, scores: Vec<fsdp_proto::v1::NodeScore>) {
        self.lock().state.straggler_scores = scores;
    }

    /// The health check failed (`Some(reason)`) or passed (`None`).
    pub fn health(&self, failed: Option<&str>) {
        let mut s = self.lock();
        if failed.is_some() {
            s.health_failures += 1;
        }
        s.state.unhealthy = failed.unwrap_or_default().to_owned();
    }

    /// The restarts `--max-restarts` is held against (all, or those in the window).
    pub fn restarts(&self, counted: u32) {
        let mut s = self.lock();
        s.state.restarts_used = counted;
        s.state.restarts_left = s.state.max_restarts.saturating_sub(counted);
    }

    /// Warm and cold worker starts so far (`--prewarm`), and why the last cold one was.
    pub fn starts(&self, warm: u32, cold: u32, last_cold: &str) {
        let mut s = self.lock();
        s.state.warm_starts = warm;
        s.state.cold_starts = cold;
        s.state.last_cold_start = last_cold.to_owned();
    }

    /// Who the hang this node declared in `round` points at.
    pub fn culprit(&self, round: u64, text: &str) {
        self.lock().state.last_hang = format!("round {round}: {text}");
    }

    /// The group lost `node` from `round`, noticed this way.
    pub fn lost(&self, node: &str, round: u64, how: fsdp_rendezvous::Detection) {
        let mut s = self.lock();
        *s.losses.entry(how.label().to_owned()).or_default() += 1;
        let detect = match how {
            fsdp_rendezvous::Detection::Refused { detect } => {
                s.refused_detect.observe(detect);
                detect
            }
            _ => Duration::ZERO,
        };
        s.state.last_loss = Some(fsdp_proto::v1::Loss {
            node_id: node.to_owned(),
            round,
            detection: how.label().to_owned(),
            detect_ms: u32::try_from(detect.as_millis()).unwrap_or(u32::MAX),
        });
    }

    /// The workers took a round in place, restoring from `from`.
    pub fn in_place(&self, from: &str) {
        *self.lock().in_place.entry(from.to_owned()).or_default() += 1;
    }

    pub fn observe_reform(&self, d: Duration) {
        self.lock().reform.observe(d);
    }

    pub fn rendezvous_error(&self) {
        self.lock().rendezvous_errors += 1;
    }
}

/// "0", "1", or the signal's name: the label of a worker exit in metrics.
pub fn exit_label(exit: WorkerExit) -> String {
    match exit {
        WorkerExit::Code(c) => c.to_string(),
        WorkerExit::Signal(s) => nix::sys::signal::Signal::try_from(s)
            .map(|s| s.as_str().to_owned())
            .unwrap_or_else(|_| format!("signal{s}")),
        WorkerExit::Lost => "lost".to_owned(),
        WorkerExit::Hung => "hung".to_owned(),
    }
}

fn worker_record(w: &WorkerStatus) -> Worker {
    let state = match w.exit {
        None => WorkerState::Running,
        Some(_) if w.stopped_by_agent => WorkerState::Stopped,
        Some(e) if e.success() => WorkerState::Succeeded,
        Some(_) => WorkerState::Failed,
    };
    let (exit_code, signal) = match w.exit {
        Some(WorkerExit::Code(c)) => (Some(c), String::new()),
        Some(WorkerExit::Signal(s)) => (Some(128 + s), exit_label(WorkerExit::Signal(s))),
        Some(WorkerExit::Lost | WorkerExit::Hung) | None => (None, String::new()),
    };
    Worker {
        local_rank: w.local_rank,
        global_rank: w.rank,
        pid: w.pid,
        state: state as i32,
        exit_code,
        signal,
    }
}
