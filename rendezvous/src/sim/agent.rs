//! A simulated agent: the real session machine, and the agent loop's rendezvous part
//! around it — the shipped [`Waiter`], driven as the handle drives it — with workers that
//! run, fail or halt the run, and a restart budget that ends the agent when spent.

use std::time::{Duration, Instant};

use fsdp_proto::{SCHEMA_VERSION, v1};

use crate::etcd::Keys;
use crate::etcd::record::{Outgoing, Record};
use crate::etcd::session::{Command, CommandId, Machine};
use crate::etcd::waiter::{Action, Waiter, Watch};
use crate::{Change, RendezvousError, Round};

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

/// Where the agent loop is (the waiter holds the rest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loop {
    /// Until the first sync.
    Starting,
    /// Waiting for a round; `begun` once the waiter began the wait (it registers).
    Waiting { begun: bool },
    /// Its workers run the waiter's held round.
    Running,
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
    /// The shipped waiter, new with each process.
    pub waiter: Waiter,
    /// Failure restarts allowed (`--max-restarts`).
    pub max_restarts: u32,
    pub asked: Option<(CommandId, Asked)>,
    next_id: CommandId,
    /// The process: answers and timers of an earlier one are dropped.
    pub process: u64,
    /// The open streams: events of closed ones are dropped.
    pub streams: u64,
    pub watching: Option<Watching>,
    /// The lease of the open keep-alive stream: the watches', or a joining node's from
    /// its grant (before its watches).
    pub kept: Option<i64>,
    /// The process whose start took its turn already (its first look waited).
    pub turn_for: u64,
    /// The turn of the process waiting to start (the handle's `await_turn`), until it
    /// came.
    pub turn: Option<crate::etcd::session::Turn>,
    /// The gate of the process waiting to start, once it looked (the handle's
    /// `through_gate`); none once it started.
    pub gate: Option<crate::etcd::session::Gate>,
    /// Until when the gate holds it (its pause), watching for the coordinator's push.
    pub held_until: Option<Instant>,
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
    /// When the loop wants to look again (a fence deadline).
    pub recheck: Option<Instant>,
    /// An exit that waits for the last command's answer.
    pub exit_after: Option<String>,
    /// It gave up its lease since it last started workers (the lease may have been
    /// gone): a round it was sealed into was never its own.
    pub abandoned: bool,
    /// Rounds this process saw itself a member of, by number and restart count (the
    /// view holds the newest round only: a node cut off may never see one it was sealed
    /// into; and a store restarted empty may number another round alike).
    pub saw_member_of: std::collections::BTreeSet<(u64, u32)>,
}

/// An agent's open watches.
#[derive(Debug, Clone)]
pub struct Watching {
    pub role: crate::etcd::session::Role,
    pub next_rev: i64,
}

/// What the loop did, for the world to carry out and check.
#[derive(Debug)]
pub enum Did {
    Ask(CommandId, Command),
    /// A command nobody waits on.
    Tell(CommandId, Command),
    /// Its workers started `round`.
    Started(Box<v1::Round>),
    /// Its workers stopped.
    Stopped(String),
    Exited(String),
    /// It leaves failed: the restart budget was spent in round `round` (restart count
    /// `count`).
    GaveUp {
        round: u64,
        count: u32,
    },
    /// Worth a line in the trace.
    Note(String),
}

impl SimAgent {
    pub fn new(
        node: String,
        keys: Keys,
        fence_margin: Duration,
        max_nodes: u32,
        max_restarts: u32,
    ) -> Self {
        Self {
            waiter: Waiter::new(node.clone(), 1, max_nodes, fence_margin),
            node,
            keys,
            machine: None,
            life: Life::Down,
            lp: Loop::Starting,
            max_restarts,
            asked: None,
            next_id: 1 << 40,
            process: 0,
            streams: 0,
            watching: None,
            kept: None,
            turn_for: 0,
            turn: None,
            gate: None,
            held_until: None,
            pinned: 0,
            cut: false,
            slow: false,
            keep_alive_ended: false,
            probing: false,
            frozen_inbox: Vec::new(),
            fence_margin,
            recheck: None,
            exit_after: None,
            abandoned: false,
            saw_member_of: Default::default(),
        }
    }

    pub fn running(&self) -> Option<&v1::Round> {
        match (&self.life, &self.lp) {
            (Life::Up | Life::Frozen, Loop::Running) => self.waiter.held().map(|h| &*h.record),
            _ => None,
        }
    }

    /// A new process: a new waiter, back to the first sync.
    pub fn restarted(&mut self, max_nodes: u32) {
        self.waiter = Waiter::new(self.node.clone(), 1, max_nodes, self.fence_margin);
        self.lp = Loop::Starting;
        // The last process's lease recheck is not this one's.
        self.recheck = None;
        self.abandoned = false;
        self.saw_member_of.clear();
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
        // A round it waits for or runs (a new process sees its old self in the newest
        // round, and rightly waits for the next).
        let looked_for = |n: u64| {
            self.lp == Loop::Running || self.waiter.waiting_for().is_some_and(|(w, _)| n >= w)
        };
        if let Some(r) = v.round.as_ref().map(|r| &r.record)
            && looked_for(r.number)
            && r.members.iter().any(|m| m.node_id == self.node)
        {
            self.saw_member_of.insert((r.number, r.restart_count));
        }
        if let Some(reason) = v.gave_up.clone() {
            let mut did: Vec<Did> = self
                .stop_workers("etcd was gone too long")
                .into_iter()
                .collect();
            did.push(self.exit(reason));
            return did;
        }
        match self.lp {
            Loop::Starting if v.connected => {
                self.lp = Loop::Waiting { begun: false };
                self.act(now)
            }
            Loop::Starting => Vec::new(),
            Loop::Waiting { begun: false } => {
                self.lp = Loop::Waiting { begun: true };
                let action = self.waiter.begin(v, now);
                self.carry_out(action)
            }
            Loop::Waiting { begun: true } => {
                let m = self.machine.as_ref().expect("checked above");
                match self.waiter.on_view(m.view(), now) {
                    Ok(action) => self.carry_out(action),
                    Err(e) => vec![self.failed(&e)],
                }
            }
            Loop::Running => self.watch_round(now),
        }
    }

    /// Does what the waiter said, as `backend.rs::next_round` does.
    fn carry_out(&mut self, action: Action) -> Vec<Did> {
        match action {
            Action::Wait => Vec::new(),
            Action::Register { wants } => {
                vec![self.ask(Command::Register { wants_round: wants }, Asked::Plain)]
            }
            Action::PublishMaster { round } => {
                let master = v1::Master {
                    schema: SCHEMA_VERSION,
                    round,
                    addr: self.node.clone(),
                    port: 29_500,
                };
                vec![self.ask(self.write(&master), Asked::Plain)]
            }
            Action::Run { record, round } => {
                if let Some(spent) = self.budget_spent(&round) {
                    return spent;
                }
                self.lp = Loop::Running;
                self.abandoned = false;
                // Told, not asked (the handle does not wait for it).
                let id = self.tell();
                let run = Command::Running {
                    round: record.clone(),
                };
                vec![
                    Did::Tell(id, run),
                    Did::Started(Box::new((*record).clone())),
                ]
            }
            Action::Charged(round) => {
                if let Some(spent) = self.budget_spent(&round) {
                    return spent;
                }
                // The loop asks for the next round.
                self.lp = Loop::Waiting { begun: false };
                vec![Did::Note(format!(
                    "round {} broke before it started; restart count {}",
                    round.number, round.restart_count
                ))]
            }
        }
    }

    /// The agent loop's budget, read from a round it was handed: spent, it leaves failed.
    fn budget_spent(&mut self, round: &Round) -> Option<Vec<Did>> {
        if round.restart_count <= self.max_restarts {
            return None;
        }
        self.lp = Loop::Waiting { begun: true };
        let why = format!("the restart budget is spent in round {}", round.number);
        self.exit_after = Some(why.clone());
        let depart = Command::Depart {
            how: crate::Departure::Failed,
            why: crate::LeftReason::new(crate::LeftKind::Failed, why),
        };
        Some(vec![
            Did::GaveUp {
                round: round.number,
                count: round.restart_count,
            },
            self.ask(depart, Asked::Last),
        ])
    }

    /// The waiter's error ends the agent, as it ends the agent loop.
    fn failed(&mut self, e: &RendezvousError) -> Did {
        match e {
            RendezvousError::Halted(h) => self.exit(format!("halted: {}", h.reason)),
            e => self.exit(format!("rendezvous error: {e}")),
        }
    }

    fn watch_round(&mut self, now: Instant) -> Vec<Did> {
        let m = self
            .machine
            .as_ref()
            .expect("an agent that acts has a machine");
        let watch = match self.waiter.on_running_view(m.view(), now) {
            Ok(w) => w,
            Err(e) => {
                let stopped = self.stop_workers("the view is corrupt");
                return stopped.into_iter().chain([self.failed(&e)]).collect();
            }
        };
        self.recheck = None;
        match watch {
            Watch::Over(change) => {
                let stopped = self.stop_workers(&format!("{change:?}"));
                let mut did: Vec<Did> = stopped.into_iter().collect();
                if let Change::Halted(h) = change {
                    did.push(self.exit(format!("halted: {}", h.reason)));
                }
                did
            }
            Watch::Fence { abandon, change } => {
                // Registered again at the next look, as the loop asks for the next round
                // once its workers stopped.
                let stopped = self.stop_workers(&format!("{change:?}"));
                self.abandoned = true;
                let id = self.tell();
                let abandon = Did::Tell(id, Command::Abandon { reason: abandon });
                stopped.into_iter().chain([abandon]).collect()
            }
            Watch::Keep { recheck } => {
                self.recheck = recheck;
                Vec::new()
            }
        }
    }

    /// Stops the workers of a running round; the loop waits for the next one.
    pub fn stop_workers(&mut self, why: &str) -> Option<Did> {
        if self.lp != Loop::Running {
            return None;
        }
        self.lp = Loop::Waiting { begun: false };
        self.recheck = None;
        Some(Did::Stopped(why.to_owned()))
    }

    /// The round its workers run: the one it failed in or halts.
    fn running_number(&self) -> Option<u64> {
        (self.lp == Loop::Running)
            .then(|| self.waiter.held().map(|h| h.record.number))
            .flatten()
    }

    /// A worker failed: charge it and re-form.
    pub fn worker_failed(&mut self) -> Vec<Did> {
        let Some(number) = self.running_number() else {
            return Vec::new();
        };
        let stopped = self.stop_workers("a worker failed");
        let failure = v1::Failure {
            schema: SCHEMA_VERSION,
            round: number,
            node_id: self.node.clone(),
        };
        let ask = self.ask(self.write(&failure), Asked::Plain);
        [stopped, Some(ask)].into_iter().flatten().collect()
    }

    /// A worker exited with a code that ends the run.
    pub fn worker_halts(&mut self) -> Vec<Did> {
        let Some(number) = self.running_number() else {
            return Vec::new();
        };
        let stopped = self.stop_workers("a worker exited 3 (no retry)");
        let halt = v1::Halt {
            schema: SCHEMA_VERSION,
            exit_code: 3,
            reason: format!("{} exited 3 in round {number}", self.node),
            node_id: self.node.clone(),
            ..Default::default()
        };
        self.exit_after = Some("it halted the run".into());
        let ask = self.ask(self.write(&halt), Asked::Last);
        [stopped, Some(ask)].into_iter().flatten().collect()
    }

    /// SIGTERM: stop the workers, leave, exit.
    pub fn terminated(&mut self) -> Vec<Did> {
        let stopped = self.stop_workers("SIGTERM");
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
