//! The pure handler on hand-built values: every phase's decisions, without a process, a
//! rendezvous or a clock.

use std::time::Duration;

use fsdp_rendezvous::{
    Change, Departure, Finish, Halt, LeftKind, RendezvousError, Round, RoundMember,
};
use nix::sys::signal::Signal;

use super::*;
use crate::config::FailurePolicy;
use crate::exit_code;
use crate::failure::{Failure, WorkerExit};
use crate::policy::AfterFailure;
use crate::run::AgentExit;
use crate::run::memory::{Memory, RoundMembers};
use crate::supervisor::GroupEvent;

const TERM: Duration = Duration::from_secs(30);

fn rules(max_restarts: u32) -> Rules {
    Rules {
        max_restarts,
        term_timeout: TERM,
        failure: FailurePolicy::default(),
    }
}

/// Round `number` of `members` (node ids), with `restart_count` charged so far.
fn round(number: u64, members: &[&str], restart_count: u32) -> Round {
    let members: Vec<RoundMember> = members
        .iter()
        .map(|id| RoundMember::unranked((*id).into(), format!("{id}.local"), 1))
        .collect();
    Round::new(
        number,
        members,
        0,
        ("a.local".into(), 29_500),
        restart_count,
        "test".into(),
    )
    .unwrap()
}

fn failure(exit: WorkerExit) -> Failure {
    Failure {
        local_rank: 0,
        rank: 3,
        pid: 42,
        exit,
        at: std::time::SystemTime::UNIX_EPOCH,
        error_file: None,
        report: None,
        stderr_tail: Vec::new(),
    }
}

fn halt(code: u8) -> Halt {
    Halt {
        node_id: "b".into(),
        exit_code: code,
        reason: "no retry".into(),
    }
}

#[test]
fn the_first_round_starts_without_a_restart_warning() {
    let mut m = Memory::default();
    let (next, counted) = formed(&mut m, &round(0, &["a"], 0), &rules(3));
    assert_eq!(next, AfterFormed::Start { restart: None });
    assert_eq!(counted, 0);
}

#[test]
fn a_round_after_a_charged_failure_warns_once_and_remembers_the_count() {
    let mut m = Memory::default();
    let (next, counted) = formed(&mut m, &round(1, &["a"], 1), &rules(3));
    let AfterFormed::Start {
        restart: Some(warning),
    } = next
    else {
        panic!("{next:?}");
    };
    assert!(warning.contains("restart 1 of 3"), "{warning}");
    assert!(!warning.contains("within"), "{warning}");
    assert_eq!((counted, m.last_restart_count), (1, 1));
    // A re-form without a new failure (a node joined) is no restart.
    let (next, _) = formed(&mut m, &round(2, &["a", "b"], 1), &rules(3));
    assert_eq!(next, AfterFormed::Start { restart: None });
}

#[test]
fn a_restart_window_is_named_in_the_warning_and_forgives_old_charges() {
    let mut r = rules(1);
    r.failure.restart_window = Some(Duration::from_secs(3600));
    let mut old = round(5, &["a"], 4);
    old.charged_at_ms = vec![1, 2, 3, old.sealed_at_ms - 1000];
    let mut m = Memory::default();
    let (next, counted) = formed(&mut m, &old, &r);
    assert_eq!(counted, 1, "three charges are older than the window");
    let AfterFormed::Start {
        restart: Some(warning),
    } = next
    else {
        panic!("{next:?}");
    };
    assert!(warning.contains("within the last 3600s"), "{warning}");
}

#[test]
fn a_spent_budget_gives_up_with_the_workers_code_and_starts_nothing() {
    let mut m = Memory {
        last_failure: Some(WorkerExit::Code(3)),
        ..Memory::default()
    };
    let (next, counted) = formed(&mut m, &round(2, &["a"], 2), &rules(1));
    assert_eq!(next, AfterFormed::GiveUp { exit_code: 3 });
    assert_eq!(counted, 2);
    assert_eq!(
        m.last_restart_count, 0,
        "a round not started is not remembered"
    );
    let leave = failed(3);
    assert_eq!(
        (leave.how, leave.exit),
        (Departure::Failed, AgentExit::Failed { exit_code: 3 })
    );
    assert_eq!(leave.why.kind, LeftKind::Failed);
    assert!(leave.why.detail.contains("exit code 3"), "{:?}", leave.why);
}

#[test]
fn a_spent_budget_without_a_failure_here_gives_the_permanent_code() {
    let mut m = Memory::default();
    let (next, _) = formed(&mut m, &round(1, &["a", "b"], 1), &rules(0));
    assert_eq!(
        next,
        AfterFormed::GiveUp {
            exit_code: exit_code::BUDGET_EXHAUSTED
        }
    );
}

#[test]
fn each_wake_while_running_leads_to_its_own_step() {
    let r = rules(0);
    assert!(matches!(on_wake(Wake::HangCheck, &r), OnWake::Judge));
    assert!(matches!(
        on_wake(Wake::Signal(Signal::SIGINT), &r),
        OnWake::Stop { signal: Signal::SIGINT, grace } if grace == TERM
    ));
    let change = Change::NewRound { number: 4 };
    assert!(matches!(
        on_wake(Wake::Changed(Ok(change.clone())), &r),
        OnWake::Reform(c) if c == change
    ));
    let broken = Wake::Changed(Err(RendezvousError::Corrupt("garbage".into())));
    assert!(matches!(
        on_wake(broken, &r),
        OnWake::Broken { grace, .. } if grace == TERM
    ));
    let first = failure(WorkerExit::Code(1));
    assert!(matches!(
        on_wake(Wake::Group(GroupEvent::Failed(first.clone())), &r),
        OnWake::Failed(f) if f.rank == first.rank
    ));
    assert!(matches!(
        on_wake(Wake::Group(GroupEvent::Succeeded), &r),
        OnWake::Finish
    ));
}

#[test]
fn a_fence_cuts_the_grace_to_half_the_time_left_and_nothing_else_does() {
    let fenced = |s| Change::Fenced {
        reason: "lease".into(),
        stop_within: Duration::from_secs(s),
    };
    assert_eq!(stop_grace(&fenced(4), TERM), Duration::from_secs(2));
    assert_eq!(
        stop_grace(&fenced(600), TERM),
        TERM,
        "never above the grace"
    );
    for other in [
        Change::MemberLost { node: "b".into() },
        Change::NodeWaiting { waiting: 1 },
        Change::PeerFailed { restart_count: 1 },
        Change::NewRound { number: 2 },
        Change::Halted(halt(3)),
    ] {
        assert_eq!(stop_grace(&other, TERM), TERM, "{other:?}");
    }
}

fn saving(step_ms: u64) -> Stoppable {
    Stoppable {
        saves_on_warning: true,
        slowest_step: Some(Duration::from_millis(step_ms)),
    }
}

#[test]
fn only_a_join_with_every_local_worker_able_to_save_in_time_warns_them_first() {
    let grace = Duration::from_secs(5);
    let join = Change::NodeWaiting { waiting: 1 };
    let first =
        |change: &Change, workers: &[Stoppable]| first_stop_signal(change, workers, grace).0;
    assert_eq!(first(&join, &[saving(100), saving(200)]), Signal::SIGUSR1);
    // What the members other than the coordinator see of the same join.
    assert_eq!(
        first(&Change::NewRound { number: 2 }, &[saving(100)]),
        Signal::SIGUSR1
    );
    // One worker that never said so (a plain script beside the trainer), or none at all
    // (no progress channel): SIGUSR1's default action would end it without a save.
    let silent = Stoppable {
        saves_on_warning: false,
        ..saving(100)
    };
    assert_eq!(first(&join, &[saving(100), silent]), Signal::SIGTERM);
    assert_eq!(first(&join, &[]), Signal::SIGTERM);
    // A step longer than half the grace: the SIGKILL could come before the save ends.
    assert_eq!(first(&join, &[saving(100), saving(2_600)]), Signal::SIGTERM);
    assert_eq!(first(&join, &[saving(2_500)]), Signal::SIGUSR1);
    // No step yet (still loading): a warning would wait for its first step.
    let starting = Stoppable {
        slowest_step: None,
        ..saving(0)
    };
    assert_eq!(first(&join, &[starting]), Signal::SIGTERM);
    // A member may be gone: a save would wait on it.
    for other in [
        Change::MemberLost { node: "b".into() },
        Change::PeerFailed { restart_count: 1 },
        Change::Fenced {
            reason: "lease".into(),
            stop_within: Duration::from_secs(4),
        },
        Change::Halted(halt(3)),
    ] {
        assert_eq!(first(&other, &[saving(100)]), Signal::SIGTERM, "{other:?}");
    }
}

#[test]
fn a_pod_delete_warns_workers_that_save_in_time_and_passes_every_other_signal_on() {
    let grace = Duration::from_secs(5);
    let to_workers = |sig, workers: &[Stoppable]| signal_for_workers(sig, workers, grace).0;
    assert_eq!(
        to_workers(Signal::SIGTERM, &[saving(100), saving(100)]),
        Signal::SIGUSR1
    );
    let silent = Stoppable {
        saves_on_warning: false,
        ..saving(100)
    };
    assert_eq!(
        to_workers(Signal::SIGTERM, &[saving(100), silent]),
        Signal::SIGTERM
    );
    assert_eq!(to_workers(Signal::SIGTERM, &[]), Signal::SIGTERM);
    assert_eq!(
        to_workers(Signal::SIGTERM, &[saving(3_000)]),
        Signal::SIGTERM
    );
    // Ctrl-C, and any other signal, reach the workers as they came.
    for other in [Signal::SIGINT, Signal::SIGHUP, Signal::SIGUSR2] {
        assert_eq!(to_workers(other, &[saving(100)]), other);
    }
}

#[test]
fn a_signal_during_a_reform_stop_wins_over_the_change() {
    let mut m = Memory::default();
    let r = round(1, &["a", "b"], 0);
    for change in [
        Change::Halted(halt(3)),
        Change::PeerFailed { restart_count: 1 },
        Change::Fenced {
            reason: "x".into(),
            stop_within: TERM,
        },
    ] {
        let next = after_change(
            &mut m,
            &r,
            &change,
            Some(Signal::SIGTERM),
            Some("a"),
            None,
            &rules(3),
        );
        assert_eq!(next, AfterChange::Leave(signalled(Signal::SIGTERM)));
    }
    assert_eq!(m.failed, None, "nothing was entered");
}

#[test]
fn another_nodes_halt_ends_this_node_with_its_code() {
    let mut m = Memory::default();
    let change = Change::Halted(halt(7));
    let next = after_change(
        &mut m,
        &round(1, &["a"], 0),
        &change,
        None,
        Some("a"),
        None,
        &rules(3),
    );
    assert_eq!(next, AfterChange::Halted(halt(7)));
}

#[test]
fn a_peers_failure_is_a_failed_attempt_here_and_may_halt_for_no_progress() {
    let mut r = rules(10);
    r.failure.no_progress_restarts = 2;
    let mut m = Memory::default();
    let change = Change::PeerFailed { restart_count: 1 };
    let mut verdicts = Vec::new();
    for n in 1..=3 {
        let this = round(n, &["a", "b"], 0);
        let next = after_change(&mut m, &this, &change, None, Some("a"), Some(10), &r);
        assert_eq!(
            m.failed,
            Some(RoundMembers::of(&this)),
            "judged at the next round"
        );
        verdicts.push(next);
    }
    assert_eq!(verdicts[0], AfterChange::PeerFailed(AfterFailure::Restart));
    assert_eq!(verdicts[1], AfterChange::PeerFailed(AfterFailure::Restart));
    assert!(
        matches!(&verdicts[2], AfterChange::PeerFailed(AfterFailure::Halt { exit_code, .. }) if *exit_code == exit_code::NO_PROGRESS),
        "{:?}",
        verdicts[2]
    );
    assert_eq!(
        m.last_failure, None,
        "a peer's failure is not this node's code"
    );
}

#[test]
fn losing_its_own_place_is_charged_and_others_losses_are_not() {
    let mut m = Memory::default();
    let r = round(1, &["a", "b"], 0);
    let mut decide =
        |change: Change, me| after_change(&mut m, &r, &change, None, me, None, &rules(3));
    let fenced = Change::Fenced {
        reason: "lease".into(),
        stop_within: TERM,
    };
    assert_eq!(decide(fenced, Some("a")), AfterChange::OwnLoss);
    let me_lost = Change::MemberLost { node: "a".into() };
    assert_eq!(decide(me_lost.clone(), Some("a")), AfterChange::OwnLoss);
    assert_eq!(
        decide(me_lost, None),
        AfterChange::Rejoin,
        "a backend without names"
    );
    let peer_lost = Change::MemberLost { node: "b".into() };
    assert_eq!(decide(peer_lost, Some("a")), AfterChange::Rejoin);
    assert_eq!(
        decide(Change::NodeWaiting { waiting: 2 }, Some("a")),
        AfterChange::Rejoin
    );
    assert_eq!(
        decide(Change::NewRound { number: 2 }, Some("a")),
        AfterChange::Rejoin
    );
}

#[test]
fn a_failure_here_is_remembered_as_the_root_cause_and_judged() {
    let mut r = rules(3);
    r.failure.no_retry_codes = vec![2];
    let mut m = Memory::default();
    let this = round(4, &["a", "b"], 1);
    let first = failure(WorkerExit::Code(2));
    let verdict = failed_here(&mut m, &this, &first, Some(5), &r);
    assert!(
        matches!(&verdict, AfterFailure::Halt { exit_code: 2, .. }),
        "{verdict:?}"
    );
    assert_eq!(m.root_cause.as_ref().map(|f| f.rank), Some(3));
    assert_eq!(m.failed, Some(RoundMembers::of(&this)));
    assert_eq!(m.ledger.best, Some(5));
    let other = failed_here(&mut m, &this, &failure(WorkerExit::Code(1)), Some(6), &r);
    assert_eq!(other, AfterFailure::Restart);
}

#[test]
fn after_a_failed_stop_a_late_signal_leaves_and_the_budget_is_not_touched() {
    let mut m = Memory::default();
    let next = after_failed(
        &mut m,
        &round(0, &["a"], 0),
        WorkerExit::Code(1),
        AfterFailure::Restart,
        Some(Signal::SIGINT),
    );
    assert_eq!(next, AfterFailed::Leave(signalled(Signal::SIGINT)));
    assert_eq!(m.last_failure, None);
}

#[test]
fn a_halt_verdict_leaves_failed_with_its_code_and_reason() {
    let mut m = Memory::default();
    let verdict = AfterFailure::Halt {
        exit_code: 9,
        reason: "why".into(),
    };
    let next = after_failed(
        &mut m,
        &round(0, &["a"], 0),
        WorkerExit::Code(9),
        verdict,
        None,
    );
    assert_eq!(
        next,
        AfterFailed::Halt {
            leave: halting(9, "why"),
            reason: "why".into()
        }
    );
    let AfterFailed::Halt { leave, .. } = next else {
        unreachable!()
    };
    assert_eq!(leave.exit, AgentExit::Failed { exit_code: 9 });
    assert_eq!(leave.why.kind, LeftKind::Halted);
    assert!(leave.why.detail.contains("why"), "{:?}", leave.why);
    assert_eq!(m.last_failure, None, "the budget is not what ends it");
}

#[test]
fn a_quarantine_verdict_leaves_without_charging_the_budget() {
    let mut m = Memory::default();
    let verdict = AfterFailure::Quarantine {
        reason: "why".into(),
    };
    let next = after_failed(
        &mut m,
        &round(0, &["a", "b"], 0),
        WorkerExit::Code(7),
        verdict,
        None,
    );
    assert_eq!(
        next,
        AfterFailed::Quarantine {
            reason: "why".into()
        }
    );
    assert_eq!(m.last_failure, None, "the budget is not what ends it");
}

#[test]
fn a_restart_remembers_the_failure_and_backs_off_by_the_restart_count() {
    let mut m = Memory::default();
    let next = after_failed(
        &mut m,
        &round(3, &["a"], 10),
        WorkerExit::Signal(11),
        AfterFailure::Restart,
        None,
    );
    let AfterFailed::Restart { backoff } = next else {
        panic!("{next:?}");
    };
    // 100 ms doubled ten times is past the 5 s cap; the jitter is ±50 %.
    assert!(
        (Duration::from_millis(2500)..=Duration::from_millis(7500)).contains(&backoff),
        "{backoff:?}"
    );
    assert_eq!(m.last_failure, Some(WorkerExit::Signal(11)));
}

#[test]
fn each_barrier_outcome_has_its_ending() {
    let AfterBarrier::Done(done) = after_barrier(Finish::AllDone) else {
        panic!("all done is done");
    };
    assert_eq!(
        (done.how, done.exit, done.why.kind),
        (Departure::Finished, AgentExit::Finished, LeftKind::Finished)
    );
    assert_eq!(
        after_barrier(Finish::Changed(Change::Halted(halt(4)))),
        AfterBarrier::Halted(halt(4))
    );
    let lost = Change::MemberLost { node: "b".into() };
    assert_eq!(
        after_barrier(Finish::Changed(lost.clone())),
        AfterBarrier::Rejoin(lost)
    );
    let AfterBarrier::TimedOut { unfinished, leave } = after_barrier(Finish::TimedOut {
        unfinished: vec!["b".into()],
    }) else {
        panic!("a barrier that ran out times out");
    };
    assert_eq!(unfinished, ["b"]);
    assert_eq!(
        (leave.how, leave.exit, leave.why.kind),
        (
            Departure::Finished,
            AgentExit::Failed {
                exit_code: exit_code::BARRIER_TIMEOUT
            },
            LeftKind::Failed
        )
    );
    assert!(
        leave.why.detail.contains("b did not") && leave.why.detail.contains("exit code 75"),
        "{:?}",
        leave.why
    );
}

#[test]
fn the_members_the_next_round_lacks_were_lost_except_this_node() {
    let mut m = Memory {
        last_round: Some(RoundMembers::of(&round(4, &["a", "b", "c"], 0))),
        ..Memory::default()
    };
    let next = round(5, &["b", "d"], 0);
    assert_eq!(
        losses(&mut m, &next, Some("a")),
        Some((4, vec!["c".to_owned()]))
    );
    assert_eq!(losses(&mut m, &next, Some("a")), None, "told once");
}

#[test]
fn the_node_first_to_fail_round_after_round_is_quarantined_by_itself_only() {
    let mut policy = FailurePolicy {
        quarantine_after: 2,
        ..FailurePolicy::default()
    };
    let members = ["a", "b"];
    let judge_as = |me: &str, policy: &FailurePolicy| {
        let mut m = Memory::default();
        let mut out = Vec::new();
        for n in 0..3 {
            m.failed = Some(RoundMembers::of(&round(n, &members, 0)));
            let next = round(n + 1, &members, 0);
            out.push(blamed(
                &mut m,
                &next,
                |_| Some("b".into()),
                policy,
                Some(me),
            ));
        }
        assert_eq!(m.failed_rounds.len(), 2, "only the last k are kept");
        out
    };
    let b = judge_as("b", &policy);
    assert_eq!(b[0], None, "one round is not enough");
    assert!(
        b[1].as_deref().is_some_and(|r| r.contains("rounds 0, 1")),
        "{b:?}"
    );
    assert!(judge_as("a", &policy).iter().all(Option::is_none));
    policy.quarantine_after = 0;
    let mut m = Memory {
        failed: Some(RoundMembers::of(&round(0, &members, 0))),
        ..Memory::default()
    };
    let next = round(1, &members, 0);
    assert_eq!(
        blamed(&mut m, &next, |_| Some("b".into()), &policy, Some("b")),
        None
    );
}

/// A worker that failed because another node's failed first (its collective cut) does not
/// give its code to a spent budget: the node exits "a peer's worker spent the budget"
/// (found under load: the secondary failure's code became the node's exit code).
#[test]
fn a_failure_that_began_on_another_node_leaves_the_budget_to_that_node() {
    let policy = FailurePolicy::default();
    let members = ["a", "b"];
    let after = |first: &'static str, me: &str| {
        let mut m = Memory {
            failed: Some(RoundMembers::of(&round(0, &members, 0))),
            last_failure: Some(WorkerExit::Code(1)),
            ..Memory::default()
        };
        let _ = blamed(
            &mut m,
            &round(1, &members, 1),
            |_| Some(first.into()),
            &policy,
            Some(me),
        );
        let spent = round(2, &members, 2);
        formed(&mut m, &spent, &rules(1)).0
    };
    assert_eq!(
        after("a", "b"),
        AfterFormed::GiveUp {
            exit_code: crate::exit_code::BUDGET_EXHAUSTED
        }
    );
    assert_eq!(after("b", "b"), AfterFormed::GiveUp { exit_code: 1 });
}

#[test]
fn a_round_that_lost_a_member_blames_nobody() {
    let policy = FailurePolicy {
        quarantine_after: 1,
        ..FailurePolicy::default()
    };
    let mut m = Memory {
        failed: Some(RoundMembers::of(&round(0, &["a", "b", "c"], 0))),
        ..Memory::default()
    };
    let next = round(1, &["a", "b"], 0);
    assert_eq!(
        blamed(&mut m, &next, |_| Some("b".into()), &policy, Some("b")),
        None
    );
    assert!(m.failed_rounds[0].lost_member);
    assert_eq!(
        blamed(&mut m, &next, |_| None, &policy, Some("b")),
        None,
        "nothing left to judge"
    );
}

#[test]
fn only_a_compared_failure_is_reported_to_the_records() {
    let policy = FailurePolicy {
        quarantine_after: 2,
        ..FailurePolicy::default()
    };
    let two = round(0, &["a", "b"], 0);
    assert!(reports_fault(&two, WorkerExit::Code(1), &policy));
    assert!(!reports_fault(&two, WorkerExit::Hung, &policy));
    assert!(!reports_fault(
        &round(0, &["a"], 0),
        WorkerExit::Code(1),
        &policy
    ));
    assert!(!reports_fault(
        &two,
        WorkerExit::Code(1),
        &FailurePolicy::default()
    ));
    assert_eq!(failure_label(WorkerExit::Hung), "hang");
    assert_eq!(failure_label(WorkerExit::Signal(9)), "worker failed");
}

#[test]
fn a_node_answers_another_nodes_hang_but_not_its_own() {
    let two = round(3, &["a", "b"], 0);
    let mut m = Memory::default();
    assert!(answers_hang(&m, &two, true));
    assert!(!answers_hang(&m, &two, false), "no progress watched");
    assert!(
        !answers_hang(&m, &round(3, &["a"], 0), true),
        "nobody to compare"
    );
    m.declared_hang = Some(RoundMembers::of(&two));
    assert!(!answers_hang(&m, &two, true), "this node declared it");
    assert!(answers_hang(&m, &round(4, &["a", "b"], 0), true));
}

#[test]
fn a_round_that_broke_before_it_started_still_spends_the_budget_it_charged() {
    let mut memory = Memory::default();
    let mut broken = round(2, &["a", "b"], 2);
    broken.broken = Some(Change::MemberLost { node: "b".into() });
    // Two restarts charged against one allowed: given up, with the budget's code.
    assert_eq!(
        spent(&memory, &broken, &rules(1)),
        Some((exit_code::BUDGET_EXHAUSTED, 2))
    );
    // Within the budget: nothing decided, nothing remembered.
    assert_eq!(spent(&memory, &broken, &rules(2)), None);
    memory.last_failure = Some(WorkerExit::Code(3));
    assert_eq!(spent(&memory, &broken, &rules(1)), Some((3, 2)));
    assert_eq!(memory.last_restart_count, 0);
}

#[test]
fn a_failure_that_re_forms_a_group_of_several_nodes_waits_to_be_blamed() {
    let two = round(1, &["a", "b"], 0);
    assert!(defer_summary(&two, true, &AfterFailure::Restart));
    // Alone, without records to learn a loss from, or ending the run: said at once.
    assert!(!defer_summary(
        &round(1, &["a"], 0),
        true,
        &AfterFailure::Restart
    ));
    assert!(!defer_summary(&two, false, &AfterFailure::Restart));
    let halt = AfterFailure::Halt {
        exit_code: 3,
        reason: "no retry".into(),
    };
    assert!(!defer_summary(&two, true, &halt));
}

#[test]
fn a_lost_peer_is_named_with_how_it_was_noticed() {
    assert_eq!(lost_peer_words(&[]), None);
    assert_eq!(
        lost_peer_words(&[("b".into(), "lease expiry"), ("c".into(), "refused")]).unwrap(),
        "node b was lost (lease expiry), node c was lost (refused)"
    );
}

#[test]
fn a_node_without_records_knows_at_once_that_the_budget_is_spent() {
    let memory = Memory {
        last_failure: Some(WorkerExit::Code(3)),
        ..Memory::default()
    };
    // --max-restarts 0: the first failure ends it, with the worker's own code.
    assert_eq!(spent_at_once(1, false, &memory, &rules(0)), Some(3));
    assert_eq!(spent_at_once(1, false, &memory, &rules(1)), None);
    // With records, the next round decides (a lost member excuses the failure).
    assert_eq!(spent_at_once(1, true, &memory, &rules(0)), None);
}

/// Every way of leaving says why, for the record status keeps after the node is gone.
#[test]
fn each_leaving_says_its_kind_and_the_detail_status_shows() {
    let cases = [
        (
            signalled(Signal::SIGTERM),
            LeftKind::Left,
            "stopped by SIGTERM; agent exit code 143",
        ),
        (
            unhealthy(79, 3, "GPU 3: 12 ECC errors (exit code 1)"),
            LeftKind::Unhealthy,
            "health check failed 3 time(s) in a row: GPU 3: 12 ECC errors (exit code 1); agent exit code 79",
        ),
        (
            kept_out("machine m1 is quarantined: first to fail"),
            LeftKind::Quarantined,
            "machine m1 is quarantined: first to fail; agent exit code 80",
        ),
        (
            halted_by(&halt(4)),
            LeftKind::Halted,
            "node b ended the run with exit code 4: no retry",
        ),
        (
            halting(78, "no progress"),
            LeftKind::Halted,
            "ended the run: no progress; agent exit code 78",
        ),
        (
            failed(76),
            LeftKind::Failed,
            "the restart budget is spent; agent exit code 76",
        ),
    ];
    for (leave, kind, detail) in cases {
        assert_eq!((leave.why.kind, leave.why.detail.as_str()), (kind, detail));
    }
    assert_eq!(
        unhealthy(79, 3, "x").exit,
        AgentExit::Failed { exit_code: 79 }
    );
    assert_eq!(unhealthy(79, 3, "x").how, Departure::Left);
}

fn worker(declared: bool, running: bool) -> Reformable {
    Reformable { declared, running }
}

#[test]
fn only_a_change_without_a_failure_and_workers_that_all_can_re_form_in_place() {
    let able = [worker(true, true), worker(true, true)];
    for change in [
        Change::MemberLost { node: "b".into() },
        Change::NodeWaiting { waiting: 1 },
        Change::NewRound { number: 2 },
    ] {
        assert!(in_place(&change, &able).0, "{change:?}");
        // One worker that never said so (a plain script beside the trainer).
        let silent = [worker(true, true), worker(false, true)];
        assert!(!in_place(&change, &silent).0, "{change:?}");
        // No worker at all: nothing to keep.
        assert!(!in_place(&change, &[]).0, "{change:?}");
        // One already exited: the next round starts fresh workers.
        let dead = [worker(true, true), worker(true, false)];
        let (keep, why) = in_place(&change, &dead);
        assert!(!keep, "{change:?}");
        assert_eq!(why, "a local worker has exited");
    }
    // A fenced node's workers must be gone before its lease can expire; a peer's failure
    // restarts every node's workers; a halt ends the run.
    for change in [
        Change::Fenced {
            reason: "lease".into(),
            stop_within: Duration::from_secs(4),
        },
        Change::PeerFailed { restart_count: 1 },
        Change::Halted(halt(3)),
    ] {
        assert!(!in_place(&change, &able).0, "{change:?}");
    }
}

#[test]
fn an_in_place_re_form_charges_nothing_and_leaves_memory_as_a_restart_would() {
    let r = round(1, &["a", "b", "c"], 2);
    let next = round(2, &["a", "b"], 2);
    for change in [
        Change::MemberLost { node: "c".into() },
        Change::NodeWaiting { waiting: 1 },
        Change::NewRound { number: 2 },
    ] {
        // In place: after_change without a stop (no late signal can come).
        let mut kept = Memory::default();
        formed(&mut kept, &r, &rules(3));
        assert_eq!(
            after_change(&mut kept, &r, &change, None, Some("a"), Some(7), &rules(3)),
            AfterChange::Rejoin
        );
        // Stopped and restarted: the same call after the stop.
        let mut stopped = Memory::default();
        formed(&mut stopped, &r, &rules(3));
        after_change(
            &mut stopped,
            &r,
            &change,
            None,
            Some("a"),
            Some(7),
            &rules(3),
        );
        assert_eq!(format!("{kept:?}"), format!("{stopped:?}"), "{change:?}");
        assert_eq!(kept.failed, None, "no failed round");
        assert_eq!(kept.last_failure, None);
        assert_eq!(kept.ledger.best, None, "no failed attempt entered");
        // The next round starts without a restart warning: nothing was charged.
        let (then, counted) = formed(&mut kept, &next, &rules(3));
        assert_eq!(then, AfterFormed::Start { restart: None });
        assert_eq!(counted, 2, "the restarts charged before, no more");
    }
    // Its own place lost: charged like a failure, so not in place (the driver stops).
    let mut m = Memory::default();
    let own = Change::MemberLost { node: "a".into() };
    assert_eq!(
        after_change(&mut m, &r, &own, None, Some("a"), None, &rules(3)),
        AfterChange::OwnLoss
    );
}

#[test]
fn the_handover_bound_is_twenty_slowest_steps_and_at_least_ninety_seconds() {
    let ms = |m| Some(Duration::from_millis(m));
    assert_eq!(handover_bound([], None), HANDOVER_MIN);
    assert_eq!(handover_bound([None, None], None), HANDOVER_MIN);
    assert_eq!(handover_bound([ms(100), ms(300)], None), HANDOVER_MIN);
    assert_eq!(
        handover_bound([ms(100), None, ms(2_000)], None),
        HANDOVER_MIN,
        "40 s is less than a frozen peer's collective timeout and a join"
    );
    assert_eq!(
        handover_bound([ms(100), None, ms(6_000)], None),
        Duration::from_secs(120)
    );
    // `--hang-timeout auto,handover=5s`: the user's allowance, shorter or longer.
    let five = Duration::from_secs(5);
    assert_eq!(handover_bound([ms(100), ms(6_000)], Some(five)), five);
    assert_eq!(
        handover_bound([], Some(10 * HANDOVER_MIN)),
        10 * HANDOVER_MIN
    );
}

#[test]
fn a_handover_is_done_when_every_worker_joined_and_falls_back_on_time_or_an_exit() {
    let t0 = std::time::Instant::now();
    let bound = Duration::from_secs(10);
    let at = |s| t0 + Duration::from_secs(s);
    let look = |now, confirmed: &[bool], alive: bool, changed| {
        let kept = if alive { Kept::Running } else { Kept::Exited };
        handover(now, t0, bound, confirmed, kept, changed)
    };
    assert_eq!(look(at(1), &[true, false], true, false), Handover::Wait);
    assert_eq!(look(at(1), &[true, true], true, false), Handover::Done);
    assert_eq!(look(at(0), &[], true, false), Handover::Wait, "no worker");
    assert!(matches!(
        look(at(10), &[true, false], true, false),
        Handover::Fallback(why) if why.contains("in time")
    ));
    // A worker that exits now fails the handover, even after the others joined.
    assert!(matches!(
        look(at(1), &[true, false], false, false),
        Handover::Fallback(why) if why.contains("exited")
    ));
    assert!(matches!(
        look(at(1), &[true, true], false, false),
        Handover::Fallback(_)
    ));
    // Every worker exited 0 (the rebuilt step was the last): the node finishes; no fresh
    // workers start, and a change still comes first.
    let succeeded = |confirmed: &[bool], changed| {
        handover(at(1), t0, bound, confirmed, Kept::Succeeded, changed)
    };
    assert_eq!(succeeded(&[false, false], false), Handover::Finished);
    assert_eq!(succeeded(&[false, false], true), Handover::Reform);
    // The group changed again: re-form with the kept workers, whatever they confirmed.
    for confirmed in [[true, true], [false, false]] {
        assert_eq!(look(at(1), &confirmed, true, true), Handover::Reform);
        assert_eq!(look(at(11), &confirmed, false, true), Handover::Reform);
    }
}

#[test]
fn a_node_whose_workers_re_form_in_place_leaves_before_stopping_them_on_sigterm() {
    let ready = Reformable {
        declared: true,
        running: true,
    };
    assert!(depart_first(Signal::SIGTERM, &[ready, ready]));
    // Ctrl-C, a second signal: stopped first, as before.
    assert!(!depart_first(Signal::SIGINT, &[ready]));
    // A worker that is restarted on a change: the others' agents would stop theirs on the
    // loss before a save, so this node's workers stop first.
    let restarted = Reformable {
        declared: false,
        running: true,
    };
    assert!(!depart_first(Signal::SIGTERM, &[ready, restarted]));
    let exited = Reformable {
        declared: true,
        running: false,
    };
    assert!(!depart_first(Signal::SIGTERM, &[exited]));
    assert!(!depart_first(Signal::SIGTERM, &[]));
}
