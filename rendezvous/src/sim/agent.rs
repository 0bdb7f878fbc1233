//! A simulated agent: the real session machine, and the agent loop's rendezvous part
//! around it, made of the real pure functions the handle uses — `step` while waiting for a
//! round, `detect` while running one, `fence::decide` for the lease — with workers that
//! run, fail or halt the run.

use std::time::{Duration, Instant};

use fsdp_proto::{SCHEMA_VERSION, v1};

use crate::etcd::Keys;
use crate::etcd::record::{Outgoing, Record};
use crate::etcd::session::{Command, CommandId, Machine};
use crate::etcd::{Step, detect, step};
use crate::fence::{self, FenceDecision};
use crate::{Change, RendezvousError};

/// Whether the agent's process runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Life {
    /// Not started yet, or killed.
    Down,
    Up,
    /// Stopped with its workers (SIGSTOP, a paused VM).
    Frozen,
    /// It exited on its own: the run halted, etcd was gone too long, or it left.
    Exited(String),
}

/// Where the agent loop is.
#[derive(Debug, Clone)]
pub enum Loop {
    /// Until the first sync.
    Starting,
    Waiting {
        wants: u64,
        since: Instant,
        published: Option<u64>,
        /// Its registration for `wants` was asked for.
        registered: bool,
    },
    /// Its workers run `record`.
    Running {
        record: Box<v1::Round>,
        since: Instant,
    },
}

/// What the loop asked the machine for and waits on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Asked {
    Plain,
    /// After this one, the agent exits with the reason.
    Last,
}

pub struct SimAgent {
    pub node: String,
    /// The run's keys, to address what it writes.
    keys: Keys,
    pub machine: Option<Machine>,
    pub life: Life,
    pub lp: Loop,
    pub asked: Option<(CommandId, Asked)>,
    next_id: CommandId,
    /// The process: answers and timers of an earlier one are dropped.
    pub process: u64,
    /// The open streams: events of closed ones are dropped.
    pub streams: u64,
    pub watching: Option<Watching>,
    pub pinned: usize,
    pub cut: bool,
    pub slow: bool,
    /// etcd ended this agent's keep-alive stream: its keep-alives go nowhere until it
    /// opens another (or new streams).
    pub keep_alive_ended: bool,
    pub probing: bool,
    /// Inputs that came while it was frozen, with the streams they came on.
    pub frozen_inbox: Vec<(Option<u64>, crate::etcd::session::Input)>,
    pub fence_margin: Duration,
    /// Test-only: never fence (the checker must catch it).
    pub broken_fence: bool,
    /// When the loop wants to look again (a fence deadline).
    pub recheck: Option<Instant>,
    /// An exit that waits for the last command's answer.
    pub exit_after: Option<String>,
}

/// An agent's open watches.
#[derive(Debug, Clone)]
pub struct Watching {
    pub role: crate::etcd::session::Role,
    pub next_rev: i64,
    pub lease: i64,
}

/// What the loop did, for the world to carry out and check.
#[derive(Debug)]
pub enum Did {
    Ask(CommandId, Command),
    /// A command nobody waits on.
    Tell(CommandId, Command),
    /// Its workers started `round`.
    Started(v1::Round),
    /// Its workers stopped.
    Stopped(String),
    Exited(String),
    /// Worth a line in the trace.
    Note(String),
}

impl SimAgent {
    pub fn new(node: String, keys: Keys, fence_margin: Duration, broken_fence: bool) -> Self {
        Self {
            node,
            keys,
            machine: None,
            life: Life::Down,
            lp: Loop::Starting,
            asked: None,
            next_id: 1 << 40,
            process: 0,
            streams: 0,
            watching: None,
            pinned: 0,
            cut: false,
            slow: false,
            keep_alive_ended: false,
            probing: false,
            frozen_inbox: Vec::new(),
            fence_margin,
            broken_fence,
            recheck: None,
            exit_after: None,
        }
    }

    pub fn running(&self) -> Option<&v1::Round> {
        match (&self.life, &self.lp) {
            (Life::Up | Life::Frozen, Loop::Running { record, .. }) => Some(record),
            _ => None,
        }
    }

    /// The command that writes `record` as its declaration says.
    fn write<R: Record>(&self, record: &R) -> Command {
        Command::Write(Outgoing::of(&self.keys, record))
    }

    fn ask(&mut self, command: Command, kind: Asked) -> Did {
        self.next_id += 1;
        self.asked = Some((self.next_id, kind));
        Did::Ask(self.next_id, command)
    }

    /// Sends a command nobody waits on (an eviction).
    pub fn tell(&mut self) -> CommandId {
        self.next_id += 1;
        self.next_id
    }

    /// The machine answered command `id`.
    pub fn answered(&mut self, id: CommandId, result: &Result<(), RendezvousError>) -> Option<Did> {
        let (asked, kind) = self.asked?;
        if asked != id {
            return None;
        }
        self.asked = None;
        if let Some(reason) = self.exit_after.take().filter(|_| kind == Asked::Last) {
            return Some(self.exit(reason));
        }
        match result {
            Ok(()) => None,
            Err(e) => Some(self.exit(format!("a command failed: {e}"))),
        }
    }

    pub fn exit(&mut self, reason: String) -> Did {
        self.life = Life::Exited(reason.clone());
        self.machine = None;
        self.watching = None;
        Did::Exited(reason)
    }

    /// One look at the view: what the loop does next, if anything.
    pub fn act(&mut self, now: Instant) -> Vec<Did> {
        if self.life != Life::Up || self.asked.is_some() {
            return Vec::new();
        }
        let Some(m) = self.machine.as_ref() else {
            return Vec::new();
        };
        let v = m.view();
        if let Some(reason) = v.gave_up.clone() {
            let mut did: Vec<Did> = self
                .stop_workers(now, "etcd was gone too long")
                .into_iter()
                .collect();
            did.push(self.exit(reason));
            return did;
        }
        match self.lp.clone() {
            Loop::Starting if v.connected => {
                let wants = v.round.as_ref().map_or(0, |r| r.record.number + 1);
                self.reform(now, wants);
                self.act(now)
            }
            Loop::Starting => Vec::new(),
            Loop::Waiting {
                wants,
                since,
                published,
                registered: false,
            } => {
                self.lp = Loop::Waiting {
                    wants,
                    since,
                    published,
                    registered: true,
                };
                vec![self.ask(Command::Register { wants_round: wants }, Asked::Plain)]
            }
            Loop::Waiting {
                wants,
                since,
                published,
                ..
            } => self.wait(now, wants, since, published),
            Loop::Running { record, since } => self.watch_round(now, &record, since),
        }
    }

    /// Whether the lease could have expired in etcd (the agent must fence).
    fn lease_may_be_gone(&self, now: Instant) -> bool {
        let Some(m) = self.machine.as_ref() else {
            return false;
        };
        let v = m.view();
        !self.broken_fence
            && matches!(
                fence::decide(now, v.lease_safe_until, self.fence_margin),
                FenceDecision::Fence { .. }
            )
    }

    fn wait(
        &mut self,
        now: Instant,
        wants: u64,
        since: Instant,
        published: Option<u64>,
    ) -> Vec<Did> {
        let m = self
            .machine
            .as_ref()
            .expect("an agent that acts has a machine");
        let next = step(m.view(), &self.node, 1, wants, published, since);
        let next = match next {
            Ok(s) => s,
            Err(RendezvousError::Halted(h)) => {
                return vec![self.exit(format!("halted: {}", h.reason))];
            }
            Err(e) => return vec![self.exit(format!("rendezvous error: {e}"))],
        };
        match next {
            Step::Wait => Vec::new(),
            Step::Done(done) => {
                let (record, _) = *done;
                if self.lease_may_be_gone(now) {
                    // Workers started now would run under a lease etcd may have expired.
                    self.reform(now, record.number + 1);
                    let reason = format!("did not start round {}", record.number);
                    return vec![self.ask(Command::Abandon { reason }, Asked::Plain)];
                }
                self.lp = Loop::Running {
                    record: Box::new((*record).clone()),
                    since,
                };
                // Told, not asked (the handle does not wait for it).
                let id = self.tell();
                let run = Did::Tell(
                    id,
                    Command::Running {
                        round: record.clone(),
                    },
                );
                vec![run, Did::Started((*record).clone())]
            }
            Step::PublishMaster { round } => {
                self.lp = Loop::Waiting {
                    wants,
                    since,
                    published: Some(round),
                    registered: true,
                };
                let master = v1::Master {
                    schema: SCHEMA_VERSION,
                    round,
                    addr: self.node.clone(),
                    port: 29_500,
                };
                vec![self.ask(self.write(&master), Asked::Plain)]
            }
            Step::Broken { next, change } => {
                self.lp = Loop::Waiting {
                    wants: next,
                    since,
                    published,
                    registered: true,
                };
                let why = format!("round {} broke before it started ({change:?}); ", next - 1);
                vec![
                    Did::Note(why),
                    self.ask(Command::Register { wants_round: next }, Asked::Plain),
                ]
            }
            Step::Spare { next, .. } => {
                self.lp = Loop::Waiting {
                    wants: next,
                    since,
                    published,
                    registered: true,
                };
                vec![self.ask(Command::Register { wants_round: next }, Asked::Plain)]
            }
        }
    }

    fn watch_round(&mut self, now: Instant, record: &v1::Round, since: Instant) -> Vec<Did> {
        let m = self
            .machine
            .as_ref()
            .expect("an agent that acts has a machine");
        let v = m.view();
        if let Some(change) = detect(v, record, &self.node, since) {
            let stopped = self.stop_workers(now, &format!("{change:?}"));
            let mut did: Vec<Did> = stopped.into_iter().collect();
            if let Change::Halted(h) = change {
                did.push(self.exit(format!("halted: {}", h.reason)));
            }
            return did;
        }
        self.recheck = None;
        if self.broken_fence {
            return Vec::new();
        }
        match fence::decide(now, v.lease_safe_until, self.fence_margin) {
            FenceDecision::Fence { reason, .. } => {
                // Registered again once the abandon is answered.
                let stopped = self.stop_workers(now, &format!("fenced: {reason}"));
                let abandon = Command::Abandon { reason };
                [stopped, Some(self.ask(abandon, Asked::Plain))]
                    .into_iter()
                    .flatten()
                    .collect()
            }
            FenceDecision::Hold { recheck_at } => {
                self.recheck = Some(recheck_at);
                Vec::new()
            }
            FenceDecision::Unknown => Vec::new(),
        }
    }

    /// Back to waiting for round `wants` (registered at the next look).
    fn reform(&mut self, now: Instant, wants: u64) {
        self.lp = Loop::Waiting {
            wants,
            since: now,
            published: None,
            registered: false,
        };
    }

    /// Stops the workers of a running round; the loop waits for the next one.
    pub fn stop_workers(&mut self, now: Instant, why: &str) -> Option<Did> {
        let Loop::Running { record, .. } = &self.lp else {
            return None;
        };
        let wants = record.number + 1;
        self.reform(now, wants);
        self.recheck = None;
        Some(Did::Stopped(why.to_owned()))
    }

    /// A worker failed: charge it and re-form.
    pub fn worker_failed(&mut self, now: Instant) -> Vec<Did> {
        let Loop::Running { record, .. } = self.lp.clone() else {
            return Vec::new();
        };
        let stopped = self.stop_workers(now, "a worker failed");
        let failure = v1::Failure {
            schema: SCHEMA_VERSION,
            round: record.number,
            node_id: self.node.clone(),
        };
        let ask = self.ask(self.write(&failure), Asked::Plain);
        [stopped, Some(ask)].into_iter().flatten().collect()
    }

    /// A worker exited with a code that ends the run.
    pub fn worker_halts(&mut self, now: Instant) -> Vec<Did> {
        let Loop::Running { record, .. } = self.lp.clone() else {
            return Vec::new();
        };
        let stopped = self.stop_workers(now, "a worker exited 3 (no retry)");
        let halt = v1::Halt {
            schema: SCHEMA_VERSION,
            exit_code: 3,
            reason: format!("{} exited 3 in round {}", self.node, record.number),
            node_id: self.node.clone(),
            ..Default::default()
        };
        self.exit_after = Some("it halted the run".into());
        let ask = self.ask(self.write(&halt), Asked::Last);
        [stopped, Some(ask)].into_iter().flatten().collect()
    }

    /// SIGTERM: stop the workers, leave, exit.
    pub fn terminated(&mut self, now: Instant) -> Vec<Did> {
        let stopped = self.stop_workers(now, "SIGTERM");
        self.exit_after = Some("SIGTERM".into());
        let ask = self.ask(
            Command::Depart {
                how: crate::Departure::Left,
                why: crate::LeftReason::new(crate::LeftKind::Left, "SIGTERM"),
            },
            Asked::Last,
        );
        [stopped, Some(ask)].into_iter().flatten().collect()
    }
}
