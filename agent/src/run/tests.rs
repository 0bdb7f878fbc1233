//! The loop in-process, in milliseconds: a scripted [`Rendezvous`] plays the group, real
//! `/bin/sh` workers play the training, signals are sent by hand. Every path between the
//! phases (re-form, failure and budget, barrier, signals anywhere, a failing rendezvous)
//! without etcd or pods.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::time::Duration;

use fsdp_rendezvous::{
    Change, Departure, Finish, LeftReason, NoRecords, Rendezvous, RendezvousError, Round,
};
use nix::sys::signal::Signal;
use tokio::sync::mpsc::UnboundedSender;

use super::{AgentExit, run};
use crate::config::{self, Config};
use crate::error::AgentError;
use crate::signals::Signals;
use crate::status::Board;

/// What the loop asked of the rendezvous, in order.
type Calls = Rc<RefCell<Vec<String>>>;

/// A rendezvous that plays a script: the rounds to hand out, and for each round whether
/// (and after how long) the group changes under it. What is not scripted never happens.
#[derive(Default)]
struct Scripted {
    rounds: VecDeque<Round>,
    /// For the round handed out at the same position: a change after a delay.
    changes: VecDeque<Option<(Duration, Result<Change, &'static str>)>>,
    /// The change of the round handed out last, and when it comes (a watch dropped and
    /// asked again, as the loop does at each look, still sees it then).
    current: Option<(tokio::time::Instant, Result<Change, &'static str>)>,
    finishes: VecDeque<Finish>,
    /// `record_failure` never answers (to interrupt it).
    failure_hangs: bool,
    /// `depart` never answers (a hung etcd).
    depart_hangs: bool,
    /// How long each round takes to form.
    round_delay: Duration,
    /// When the change is due, the runtime's one thread blocks until this file exists and
    /// a while after: a worker that exits meanwhile is not reported before the change is
    /// seen (an agent's waiter delayed on a busy machine).
    block_for: Option<std::path::PathBuf>,
    calls: Calls,
}

impl Scripted {
    fn call(&self, what: impl Into<String>) {
        self.calls.borrow_mut().push(what.into());
    }
}

impl Rendezvous for Scripted {
    type Records = NoRecords;

    fn records(&mut self) -> Option<&mut NoRecords> {
        None
    }

    fn backend(&self) -> &'static str {
        "scripted"
    }

    fn run_id(&self) -> &str {
        "scripted"
    }

    async fn next_round(&mut self) -> Result<Round, RendezvousError> {
        self.call("next_round");
        tokio::time::sleep(self.round_delay).await;
        self.current = self
            .changes
            .pop_front()
            .flatten()
            .map(|(after, change)| (tokio::time::Instant::now() + after, change));
        match self.rounds.pop_front() {
            Some(r) => Ok(r),
            None => std::future::pending().await,
        }
    }

    async fn changed(&mut self) -> Result<Change, RendezvousError> {
        let Some((at, _)) = &self.current else {
            return std::future::pending().await;
        };
        tokio::time::sleep_until(*at).await;
        if let Some(file) = &self.block_for {
            let until = std::time::Instant::now() + Duration::from_secs(20);
            while !file.exists() && std::time::Instant::now() < until {
                std::thread::sleep(Duration::from_millis(10));
            }
            std::thread::sleep(Duration::from_millis(300));
        }
        let (_, change) = self.current.take().expect("the change is still there");
        change.map_err(|e| RendezvousError::Corrupt(e.into()))
    }

    async fn record_failure(&mut self) -> Result<u32, RendezvousError> {
        self.call("record_failure");
        if self.failure_hangs {
            std::future::pending::<()>().await;
        }
        Ok(0)
    }

    async fn finish(&mut self, _timeout: Duration) -> Result<Finish, RendezvousError> {
        self.call("finish");
        Ok(self.finishes.pop_front().unwrap_or(Finish::AllDone))
    }

    async fn depart(&mut self, how: Departure, why: LeftReason) -> Result<(), RendezvousError> {
        self.call(format!("depart {how:?}: {}", why.kind.label()));
        if self.depart_hangs {
            std::future::pending::<()>().await;
        }
        Ok(())
    }
}

/// A one-node round; `base_rank` tells the workers which round they are in (`$RANK`).
fn round(number: u64, base_rank: u32, restart_count: u32) -> Round {
    Round {
        number,
        group_rank: 0,
        group_world_size: 1,
        base_rank,
        world_size: base_rank + 1,
        master_addr: "127.0.0.1".into(),
        master_port: 29_500,
        restart_count,
        members: Vec::new().into(),
        reason: "scripted".into(),
        charged_at_ms: Vec::new(),
        sealed_at_ms: 0,
        broken: None,
    }
}

/// One worker running `script` under `sh -c`, with `flags` for the agent.
fn config(flags: &[&str], script: &str) -> Config {
    let mut argv: Vec<std::ffi::OsString> = vec!["fsdp-agent".into()];
    argv.extend(
        [
            "--standalone",
            "--log-dir",
            "/dev/null",
            "--term-timeout",
            "5",
        ]
        .map(Into::into),
    );
    argv.extend(flags.iter().map(Into::into));
    argv.extend(["--no-python", "/bin/sh", "-c", script].map(Into::into));
    config::resolve(argv, &|_| None).unwrap_or_else(|e| panic!("config: {e:?}"))
}

/// Runs the loop over `rdzv`; `signal` is sent after `after`, if given.
fn play(
    cfg: &Config,
    rdzv: Scripted,
    signal: Option<(Duration, Signal)>,
) -> (Result<AgentExit, AgentError>, Vec<String>) {
    let board = Board::new("scripted", "scripted", cfg.max_restarts);
    play_on(cfg, rdzv, signal, &board)
}

/// [`play`], reporting to `board`.
fn play_on(
    cfg: &Config,
    mut rdzv: Scripted,
    signal: Option<(Duration, Signal)>,
    board: &Board,
) -> (Result<AgentExit, AgentError>, Vec<String>) {
    let calls = rdzv.calls.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let result = rt.block_on(async {
        let (tx, mut signals): (UnboundedSender<Signal>, Signals) = Signals::by_hand();
        if let Some((after, sig)) = signal {
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                let _ = tx.send(sig);
            });
        }
        let run = run(cfg, &mut rdzv, &mut signals, board);
        tokio::time::timeout(Duration::from_secs(30), run)
            .await
            .expect("the loop ended within 30 s")
    });
    let calls = calls.borrow().clone();
    (result, calls)
}

#[test]
fn a_group_change_stops_the_workers_and_the_next_round_runs() {
    // Round 0's worker (RANK 10) would run for a minute; round 1's succeeds at once.
    let cfg = config(&[], r#"[ "$RANK" = 10 ] && exec sleep 60; exit 0"#);
    let rdzv = Scripted {
        rounds: [round(0, 10, 0), round(1, 0, 0)].into(),
        changes: [Some((
            Duration::from_millis(200),
            Ok(Change::NewRound { number: 1 }),
        ))]
        .into(),
        ..Scripted::default()
    };
    let (result, calls) = play(&cfg, rdzv, None);
    assert_eq!(result.unwrap(), AgentExit::Finished);
    assert_eq!(
        calls,
        [
            "next_round",
            "next_round",
            "finish",
            "depart Finished: finished"
        ]
    );
}

#[test]
fn a_failure_is_charged_and_the_group_restarts_within_the_budget() {
    let cfg = config(
        &["--max-restarts", "1"],
        r#"[ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && exit 3; exit 0"#,
    );
    let rdzv = Scripted {
        rounds: [round(0, 0, 0), round(1, 0, 1)].into(),
        ..Scripted::default()
    };
    let (result, calls) = play(&cfg, rdzv, None);
    assert_eq!(result.unwrap(), AgentExit::Finished);
    assert_eq!(
        calls,
        [
            "next_round",
            "record_failure",
            "next_round",
            "finish",
            "depart Finished: finished"
        ]
    );
}

/// What a node whose own worker spent the budget asks of the rendezvous: the failure
/// charged, the next round (which says the budget is spent), its departure.
const SPENT_ON_OWN_FAILURE: [&str; 4] = [
    "next_round",
    "record_failure",
    "next_round",
    "depart Failed: failed",
];

#[test]
fn a_spent_budget_ends_with_the_workers_own_code() {
    let cfg = config(&[], "exit 3");
    let rdzv = Scripted {
        rounds: [round(0, 0, 0), round(1, 0, 1)].into(),
        ..Scripted::default()
    };
    let (result, calls) = play(&cfg, rdzv, None);
    assert_eq!(result.unwrap(), AgentExit::Failed { exit_code: 3 });
    assert_eq!(calls, SPENT_ON_OWN_FAILURE);
}

#[test]
fn a_worker_that_failed_before_a_peers_failure_was_seen_is_this_nodes_failure() {
    // The worker exits 3 and the agent, busy, sees another node's failure before its own
    // worker's exit: the exit came before any stop signal, so it is this node's failure
    // (charged and reported), and the spent budget ends with its code, not 76.
    let dir = tempfile::tempdir().unwrap();
    let exiting = dir.path().join("exiting");
    let cfg = config(
        &[],
        &format!("sleep 0.2; touch {}; exit 3", exiting.display()),
    );
    let rdzv = Scripted {
        rounds: [round(0, 0, 0), round(1, 0, 1)].into(),
        changes: [Some((
            Duration::from_millis(50),
            Ok(Change::PeerFailed { restart_count: 1 }),
        ))]
        .into(),
        block_for: Some(exiting),
        ..Scripted::default()
    };
    let (result, calls) = play(&cfg, rdzv, None);
    assert_eq!(result.unwrap(), AgentExit::Failed { exit_code: 3 });
    assert_eq!(calls, SPENT_ON_OWN_FAILURE);
}

#[test]
fn a_signal_while_workers_run_stops_them_and_leaves() {
    let cfg = config(&[], "exec sleep 60");
    let rdzv = Scripted {
        rounds: [round(0, 0, 0)].into(),
        ..Scripted::default()
    };
    let signal = Some((Duration::from_millis(300), Signal::SIGTERM));
    let (result, calls) = play(&cfg, rdzv, signal);
    assert_eq!(result.unwrap(), AgentExit::Signalled(Signal::SIGTERM));
    assert_eq!(calls, ["next_round", "depart Left: left"]);
}

#[test]
fn a_signal_during_the_rendezvous_leaves_at_once() {
    let cfg = config(&[], "exit 0");
    // No round ever comes.
    let (result, calls) = play(
        &cfg,
        Scripted::default(),
        Some((Duration::from_millis(100), Signal::SIGINT)),
    );
    assert_eq!(result.unwrap(), AgentExit::Signalled(Signal::SIGINT));
    assert_eq!(calls, ["next_round", "depart Left: left"]);
}

#[test]
fn a_signal_while_reporting_a_failure_is_not_lost() {
    let cfg = config(&["--max-restarts", "3"], "exit 3");
    let rdzv = Scripted {
        rounds: [round(0, 0, 0)].into(),
        failure_hangs: true,
        ..Scripted::default()
    };
    let signal = Some((Duration::from_millis(500), Signal::SIGTERM));
    let (result, calls) = play(&cfg, rdzv, signal);
    assert_eq!(result.unwrap(), AgentExit::Signalled(Signal::SIGTERM));
    assert_eq!(calls, ["next_round", "record_failure", "depart Left: left"]);
}

#[test]
fn a_group_that_breaks_in_the_exit_barrier_runs_again() {
    let cfg = config(&[], "exit 0");
    let rdzv = Scripted {
        rounds: [round(0, 0, 0), round(1, 0, 0)].into(),
        finishes: [Finish::Changed(Change::MemberLost { node: "b".into() })].into(),
        ..Scripted::default()
    };
    let (result, calls) = play(&cfg, rdzv, None);
    assert_eq!(result.unwrap(), AgentExit::Finished);
    assert_eq!(
        calls,
        [
            "next_round",
            "finish",
            "next_round",
            "finish",
            "depart Finished: finished"
        ]
    );
}

#[test]
fn peers_that_never_finish_end_in_the_barrier_timeout_code() {
    let cfg = config(&[], "exit 0");
    let rdzv = Scripted {
        rounds: [round(0, 0, 0)].into(),
        finishes: [Finish::TimedOut {
            unfinished: vec!["b".into()],
        }]
        .into(),
        ..Scripted::default()
    };
    let (result, _) = play(&cfg, rdzv, None);
    assert_eq!(
        result.unwrap(),
        AgentExit::Failed {
            exit_code: crate::exit_code::BARRIER_TIMEOUT
        }
    );
}

#[test]
fn a_rendezvous_error_while_workers_run_stops_them_and_is_exit_69() {
    let dir = std::env::temp_dir().join(format!("fsdp-loop-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pid_file = dir.join("pid");
    let cfg = config(
        &[],
        &format!("echo $$ > {}; exec sleep 60", pid_file.display()),
    );
    let rdzv = Scripted {
        rounds: [round(0, 0, 0)].into(),
        changes: [Some((
            Duration::from_millis(300),
            Err("garbage in ctl/round"),
        ))]
        .into(),
        ..Scripted::default()
    };
    let (result, calls) = play(&cfg, rdzv, None);
    let err = result.unwrap_err();
    assert_eq!(err.exit_code(), crate::exit_code::RENDEZVOUS_UNAVAILABLE);
    assert!(
        err.chain().contains("garbage in ctl/round"),
        "{}",
        err.chain()
    );
    assert_eq!(calls, ["next_round"]);
    let pid: i32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // Reaped by the stop: no such process any more.
    assert!(nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rendezvous_that_never_takes_the_goodbye_does_not_keep_the_agent() {
    let cfg = config(&[], "exit 0");
    let rdzv = Scripted {
        rounds: [round(0, 0, 0)].into(),
        depart_hangs: true,
        ..Scripted::default()
    };
    let (result, calls) = play(&cfg, rdzv, None);
    assert_eq!(result.unwrap(), AgentExit::Finished);
    assert_eq!(calls, ["next_round", "finish", "depart Finished: finished"]);
}

/// A worker's control side played by a thread of the test, for a `sh` worker that writes
/// `$FSDP_AGENT_PROGRESS $FSDP_AGENT_CONTROL $RANK $$` to `spawned` at each start and
/// sleeps: it binds the control socket of the first start and says it re-forms in place;
/// with `Some(Ok(from))` it takes one round and says it joined it under the round's rank,
/// restored from `from` (the round's datagram is returned), with `Some(Err(after))` the
/// worker is killed that long after, and with `None` it closes its socket at once.
fn worker_side(
    spawned: std::path::PathBuf,
    answer: Option<Result<&'static str, Duration>>,
) -> std::thread::JoinHandle<Option<String>> {
    std::thread::spawn(move || {
        let line = (0..1000)
            .find_map(|_| {
                let text = std::fs::read_to_string(&spawned).unwrap_or_default();
                let line = text.lines().next().map(str::to_owned);
                if line.is_none() {
                    std::thread::sleep(Duration::from_millis(10));
                }
                line
            })
            .expect("the worker started");
        let words: Vec<&str> = line.split(' ').collect();
        let [progress, control, rank, _] = words[..] else {
            panic!("progress and control offered: '{line}'");
        };
        let ctl = std::os::unix::net::UnixDatagram::bind(control).unwrap();
        let out = std::os::unix::net::UnixDatagram::unbound().unwrap();
        let say = |text: String| out.send_to(text.as_bytes(), progress).unwrap();
        say(format!("{rank} can re-form-in-place"));
        let from = match answer? {
            Ok(from) => from,
            Err(after) => {
                // The worker dies while its agent waits for the next round.
                std::thread::sleep(after);
                let pid: i32 = words[3].parse().unwrap();
                let pid = nix::unistd::Pid::from_raw(pid);
                nix::sys::signal::kill(pid, Signal::SIGKILL).unwrap();
                return None;
            }
        };
        ctl.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = [0u8; 1024];
        let n = ctl.recv(&mut buf).unwrap();
        let order = String::from_utf8_lossy(&buf[..n]).into_owned();
        let number = order.split(' ').nth(1).unwrap();
        let rank = order
            .split(' ')
            .find_map(|w| w.strip_prefix("RANK="))
            .unwrap();
        say(format!("{rank} reforming"));
        say(format!("{rank} joined {number} {from}"));
        Some(order)
    })
}

/// The `sh` worker of [`worker_side`].
fn reporting_worker(spawned: &std::path::Path) -> String {
    format!(
        r#"echo "$FSDP_AGENT_PROGRESS $FSDP_AGENT_CONTROL $RANK $$" >> {}; exec sleep 60"#,
        spawned.display()
    )
}

/// Round 0 (rank 10) changes after a second; round 1 (rank 0) runs until a SIGTERM.
fn in_place_script() -> Scripted {
    Scripted {
        rounds: [round(0, 10, 0), round(1, 0, 0)].into(),
        changes: [Some((
            Duration::from_millis(1_000),
            Ok(Change::NewRound { number: 1 }),
        ))]
        .into(),
        ..Scripted::default()
    }
}

#[test]
fn workers_that_re_form_in_place_keep_their_process_and_take_the_next_round() {
    let dir = tempfile::tempdir().unwrap();
    let spawned = dir.path().join("spawned");
    let cfg = config(&[], &reporting_worker(&spawned));
    let side = worker_side(spawned.clone(), Some(Ok("memory")));
    let signal = Some((Duration::from_millis(2_500), Signal::SIGTERM));
    let board = Board::new("scripted", "scripted", cfg.max_restarts);
    let (result, calls) = play_on(&cfg, in_place_script(), signal, &board);
    let restored = board.snapshot().in_place;
    assert_eq!(restored, [("memory".to_owned(), 1)].into(), "{restored:?}");
    assert_eq!(result.unwrap(), AgentExit::Signalled(Signal::SIGTERM));
    assert_eq!(calls, ["next_round", "next_round", "depart Left: left"]);
    let order = side.join().unwrap().unwrap();
    assert_eq!(
        order,
        "round 1 RANK=0 LOCAL_RANK=0 GROUP_RANK=0 ROLE_RANK=0 LOCAL_WORLD_SIZE=1 \
         WORLD_SIZE=1 GROUP_WORLD_SIZE=1 ROLE_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 \
         MASTER_PORT=29500 TORCHELASTIC_RESTART_COUNT=0"
    );
    let starts = std::fs::read_to_string(&spawned).unwrap();
    assert_eq!(
        starts.lines().count(),
        1,
        "one process for both rounds: {starts}"
    );
}

#[test]
fn a_re_form_in_place_that_fell_back_to_disk_is_counted_so() {
    let dir = tempfile::tempdir().unwrap();
    let spawned = dir.path().join("spawned");
    let cfg = config(&[], &reporting_worker(&spawned));
    let side = worker_side(spawned.clone(), Some(Ok("disk")));
    let signal = Some((Duration::from_millis(2_500), Signal::SIGTERM));
    let board = Board::new("scripted", "scripted", cfg.max_restarts);
    let (result, _) = play_on(&cfg, in_place_script(), signal, &board);
    assert_eq!(result.unwrap(), AgentExit::Signalled(Signal::SIGTERM));
    side.join().unwrap().unwrap();
    let snapshot = board.snapshot();
    assert_eq!(snapshot.in_place, [("disk".to_owned(), 1)].into());
    let text = crate::status::metrics::render(&snapshot);
    assert!(
        text.contains("fsdp_agent_in_place_reforms_total{restored=\"disk\"} 1"),
        "{text}"
    );
}

#[test]
fn workers_that_cannot_take_the_round_are_stopped_and_fresh_ones_start_uncharged() {
    let dir = tempfile::tempdir().unwrap();
    let spawned = dir.path().join("spawned");
    let cfg = config(&[], &reporting_worker(&spawned));
    // It says it can, then closes its socket: the round's send is refused.
    let side = worker_side(spawned.clone(), None);
    let signal = Some((Duration::from_millis(2_500), Signal::SIGTERM));
    let (result, calls) = play(&cfg, in_place_script(), signal);
    assert_eq!(result.unwrap(), AgentExit::Signalled(Signal::SIGTERM));
    assert_eq!(side.join().unwrap(), None);
    // Nothing charged: no record_failure.
    assert_eq!(calls, ["next_round", "next_round", "depart Left: left"]);
    let starts = std::fs::read_to_string(&spawned).unwrap();
    assert_eq!(
        ranks(&starts),
        ["10", "0"],
        "a fresh worker for round 1: {starts}"
    );
}

/// The `$RANK` of each start of a [`reporting_worker`].
fn ranks(starts: &str) -> Vec<&str> {
    starts
        .lines()
        .map(|l| l.split(' ').nth(2).unwrap())
        .collect()
}

#[test]
fn a_kept_worker_that_dies_before_the_next_round_is_replaced_uncharged() {
    let dir = tempfile::tempdir().unwrap();
    let spawned = dir.path().join("spawned");
    let cfg = config(&[], &reporting_worker(&spawned));
    // Killed half a second into the next round's rendezvous.
    let side = worker_side(spawned.clone(), Some(Err(Duration::from_millis(1_500))));
    let rdzv = Scripted {
        round_delay: Duration::from_millis(1_000),
        ..in_place_script()
    };
    let signal = Some((Duration::from_millis(4_500), Signal::SIGTERM));
    let (result, calls) = play(&cfg, rdzv, signal);
    assert_eq!(result.unwrap(), AgentExit::Signalled(Signal::SIGTERM));
    assert_eq!(side.join().unwrap(), None);
    assert!(!calls.iter().any(|c| c == "record_failure"), "{calls:?}");
    let starts = std::fs::read_to_string(&spawned).unwrap();
    assert_eq!(
        ranks(&starts),
        ["10", "0"],
        "a fresh worker for round 1: {starts}"
    );
}
