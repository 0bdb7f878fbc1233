//! The failure policy: failures that no restart mends end the run on every
//! node at once, with the budget untouched — real etcd, pods and gloo workers.

use std::time::{Duration, Instant};

use fsdp_tests::job::Job;
use fsdp_tests::{AgentCmd, TempDir, python, status_cmd, workspace_file};

const LIMIT: Duration = Duration::from_secs(120);

fn worker(job: &Job, script: &str, args: &[&str]) -> Vec<String> {
    let mut w = vec![
        workspace_file(script).display().to_string(),
        job.dir.path().join("ckpt").display().to_string(),
    ];
    w.extend(args.iter().map(|s| (*s).to_owned()));
    std::fs::create_dir_all(job.dir.path().join("ckpt")).unwrap();
    w
}

fn status_json(job: &Job) -> serde_json::Value {
    let (code, json, err) = status_cmd(&[
        "--json",
        "--rdzv-endpoint",
        &job.endpoint(),
        "--rdzv-id",
        &job.run_id,
    ]);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&json).unwrap()
}

/// A worker on pod 1 exits 3, a code `--no-retry-exit-codes` marks as not worth a retry:
/// both pods exit 3 within seconds, though the budget would allow three restarts, and the
/// run's status shows the budget unspent and who ended the run.
#[test]
fn a_no_retry_exit_code_ends_the_run_on_every_node_with_the_budget_unspent() {
    let job = Job::new("noretry", "2:2", 3, 0, 21);
    let w = worker(
        &job,
        "tests/py/elastic_worker.py",
        &["1000000", "--fail-on", "pod1"],
    );
    let t0 = Instant::now();
    let mut pods: Vec<_> = (0..2)
        .map(|i| job.pod_running(i, 1, &["--no-retry-exit-codes", "2,3"], &w))
        .collect();
    for p in &mut pods {
        assert_eq!(p.wait(LIMIT), 3, "{}", p.output());
    }
    // Two interpreters' start-up (torch imports) and the halt: seconds, not restarts.
    assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
    let starts = |p: &fsdp_tests::pod::Pod| fsdp_tests::job::starts(p).len();
    // What each pod did, for the one time in a loaded suite this failed (2026-11-30).
    let said = || {
        let outputs: Vec<String> = pods.iter().map(|p| p.output()).collect();
        outputs.join("\n")
    };
    assert!(
        pods.iter().all(|p| starts(p) == 1),
        "one attempt each\n{}",
        said()
    );
    assert!(
        pods[0].stderr().contains("another node ended the run"),
        "{}",
        pods[0].stderr()
    );
    let s = status_json(&job);
    let outputs: Vec<String> = pods.iter().map(|p| p.output()).collect();
    assert_eq!(s["restarts"], 0, "{s}\n{}", outputs.join("\n"));
    assert_eq!(s["health"], "halted", "{s}\n{}", outputs.join("\n"));
    assert_eq!(s["health"], "halted", "{s}");
    let why = s["health_reason"].as_str().unwrap();
    assert!(
        why.contains("exit code 3") && why.contains("pod1-"),
        "{why}"
    );
}

/// Rank 0 crashes right after step 10, each attempt resuming from the checkpoint of step
/// 5: after three restarts that never get past step 10 the agent stops with 78, long
/// before `--max-restarts 20` would.
#[test]
fn restarts_that_make_no_progress_stop_with_their_own_code() {
    let dir = TempDir::new().unwrap();
    let ckpt = dir.path().join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .env("PYTHON", python())
        .args([
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "20",
        ])
        .args(["--no-progress-restarts", "3"])
        .args(fsdp_tests::WHOLE_LINES)
        .arg_path(workspace_file("tests/py/crashloop_worker.py"))
        .arg_path(&ckpt)
        .args(["10"])
        .run(LIMIT);
    assert_eq!(a.code(), 78, "{}", a.output());
    let out = a.stdout();
    // Attempt 0 from step 0, then restarts 1-3 from step 5; no fifth attempt.
    let rank0: Vec<&str> = out.lines().filter(|l| l.contains("start rank=0")).collect();
    assert_eq!(rank0.len(), 4, "{out}");
    assert!(rank0[1..].iter().all(|l| l.contains("step=5")), "{out}");
    let err = a.stderr();
    assert!(
        err.contains("3 attempts in a row never got past step 10"),
        "{err}"
    );
}

/// A worker that runs a second and fails, four attempts in a row, under `--max-restarts 1`:
/// with a half-second `--restart-window` each failure is forgiven before the next and the
/// fifth attempt finishes; counted over the whole run (torchrun's rule) the second failure
/// ends the job.
#[test]
fn failures_spaced_beyond_the_restart_window_never_exhaust_the_budget() {
    let run = |window: Option<&str>| {
        let dir = TempDir::new().unwrap();
        let mut cmd = AgentCmd::new(dir.path(), "agent").args([
            "--standalone",
            "--no-python",
            "--max-restarts",
            "1",
        ]);
        if let Some(w) = window {
            cmd = cmd.args(["--restart-window", w]);
        }
        let mut a = cmd
            .arg_path(fsdp_tests::fake_worker())
            .args(["--exit-code", "1", "--fail-until-restart", "4"])
            .args(["--fail-after", "1.0"])
            .run(LIMIT);
        (a.code(), a.stderr())
    };
    let (code, err) = run(Some("0.5"));
    assert_eq!(code, 0, "{err}");
    assert_eq!(err.matches("worker group failed").count(), 4, "{err}");
    assert!(
        err.contains("restart 1 of 1 within the last 500ms"),
        "{err}"
    );
    let (code, err) = run(None);
    assert_eq!(code, 1, "{err}");
    assert_eq!(err.matches("worker group failed").count(), 2, "{err}");
}

/// Pod 2's health check fails (a bad GPU, say): pods 0 and 1 form a group of 2 without
/// it, `fsdp-agent status` names pod 2 and the check's last line, and once the check
/// passes pod 2 joins and the group grows to 3.
#[test]
fn a_node_whose_health_check_fails_stays_out_until_it_passes() {
    let mut job = Job::new("health", "2:3", 0, 1_000_000, 22);
    job.rdzv_conf = "last_call_timeout=1".into();
    let w = worker(&job, "tests/py/elastic_worker.py", &["1000000"]);
    let ok = job.dir.path().join("pod2-gpu-ok");
    let check = format!(
        "test -e {} || {{ echo checking GPUs; echo 'GPU 3: 12 uncorrectable ECC errors'; exit 1; }}",
        ok.display()
    );
    let pods: Vec<_> = (0..2).map(|i| job.pod_running(i, 1, &[], &w)).collect();
    let bad = job.pod_running(
        2,
        1,
        &["--health-check", &check, "--health-check-attempts", "100"],
        &w,
    );
    let all: Vec<&fsdp_tests::pod::Pod> = pods.iter().chain([&bad]).collect();
    fsdp_tests::job::wait_until("a group of 2 without pod 2", &all, || {
        pods.iter()
            .all(|p| fsdp_tests::job::nth_start_world(p, 0, 2))
    });
    assert!(fsdp_tests::job::starts(&bad).is_empty(), "{}", bad.output());
    let (_, table, _) = status_cmd(&["--rdzv-endpoint", &job.endpoint(), "--rdzv-id", &job.run_id]);
    let line = table
        .lines()
        .find(|l| l.starts_with("unhealthy"))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(
        line.contains("pod2-") && line.contains("GPU 3: 12 uncorrectable ECC errors (exit code 1)"),
        "{table}"
    );
    std::fs::write(&ok, "").unwrap();
    fsdp_tests::job::wait_until("pod 2 to join a group of 3", &all, || {
        all.iter().all(|p| {
            fsdp_tests::job::starts(p)
                .last()
                .is_some_and(|s| s.world == 3)
        })
    });
    let (_, table, _) = status_cmd(&["--rdzv-endpoint", &job.endpoint(), "--rdzv-id", &job.run_id]);
    assert!(!table.contains("unhealthy"), "{table}");
    assert!(
        bad.stderr().contains("the health check passes again"),
        "{}",
        bad.stderr()
    );
}

/// A health check that never passes: after `--health-check-attempts` failures in a row the
/// agent exits 79 (replace the node), having started no worker.
#[test]
fn a_health_check_that_keeps_failing_exits_79() {
    let dir = TempDir::new().unwrap();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .args(["--standalone", "--no-python"])
        .args(["--health-check", "echo 'NIC mlx5_0 is down'; exit 2"])
        .args(["--health-check-attempts", "2"])
        .arg_path(fsdp_tests::fake_worker())
        .args(["--dir"])
        .arg_path(dir.path())
        .run(LIMIT);
    assert_eq!(a.code(), 79, "{}", a.output());
    let err = a.stderr();
    assert!(err.contains("NIC mlx5_0 is down (exit code 2)"), "{err}");
    assert!(
        !std::fs::read_dir(dir.path()).unwrap().any(|e| e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .starts_with("pid.")),
        "a worker was started"
    );
}

/// Hot spares. `--nnodes 2:2` with three pods: one waits as a spare; SIGKILL a member and
/// the spare takes its place in the same re-form, so the world stays 2.
#[test]
fn a_spare_replaces_a_killed_member_and_the_world_size_stays() {
    let mut job = Job::new("spare", "2:2", 0, 1_000_000, 23);
    job.rdzv_conf = "last_call_timeout=1".into();
    let w = worker(&job, "tests/py/elastic_worker.py", &["1000000"]);
    let mut pods: Vec<_> = (0..3).map(|i| job.pod_running(i, 1, &[], &w)).collect();
    let running = |pods: &[fsdp_tests::pod::Pod]| -> Vec<usize> {
        (0..pods.len())
            .filter(|&i| !fsdp_tests::job::starts(&pods[i]).is_empty())
            .collect()
    };
    {
        let all: Vec<&fsdp_tests::pod::Pod> = pods.iter().collect();
        fsdp_tests::job::wait_until("a group of 2", &all, || running(&pods).len() == 2);
        job.progresses(3, &all);
    }
    let members = running(&pods);
    assert_eq!(members.len(), 2, "one pod is a spare");
    let spare = (0..3).find(|i| !members.contains(i)).unwrap();
    let (victim, survivor) = (members[0], members[1]);
    pods[victim].kill();
    let live: Vec<&fsdp_tests::pod::Pod> = [&pods[spare], &pods[survivor]].into();
    fsdp_tests::job::wait_until("the spare to start", &live, || {
        !fsdp_tests::job::starts(&pods[spare]).is_empty()
    });
    job.progresses(3, &live);
    for i in [spare, survivor] {
        let worlds: Vec<u32> = fsdp_tests::job::starts(&pods[i])
            .iter()
            .map(|s| s.world)
            .collect();
        assert!(worlds.iter().all(|&w| w == 2), "pod {i}: {worlds:?}");
    }
}

/// Four pods alive with MAX 2 at a re-form (every worker fails once): the new round has
/// exactly two members, and the two spares keep waiting.
#[test]
fn more_live_agents_than_max_at_a_re_form_make_a_round_of_max() {
    let mut job = Job::new("spares4", "2:2", 1, 1_000_000, 24);
    job.rdzv_conf = "last_call_timeout=1".into();
    let w = worker(
        &job,
        "tests/py/elastic_worker.py",
        &["1000000", "--fail-first-on-all"],
    );
    let pods: Vec<_> = (0..4).map(|i| job.pod_running(i, 1, &[], &w)).collect();
    let all: Vec<&fsdp_tests::pod::Pod> = pods.iter().collect();
    let restarted = || {
        pods.iter()
            .filter(|p| fsdp_tests::job::starts(p).iter().any(|s| s.restart == 1))
            .count()
    };
    fsdp_tests::job::wait_until("the group to restart", &all, || restarted() >= 2);
    job.progresses(3, &all);
    assert_eq!(restarted(), 2);
    for p in &pods {
        for s in fsdp_tests::job::starts(p) {
            assert_eq!(s.world, 2, "{}", p.output());
        }
    }
    let (_, json, _) = status_cmd(&[
        "--json",
        "--rdzv-endpoint",
        &job.endpoint(),
        "--rdzv-id",
        &job.run_id,
    ]);
    let s: serde_json::Value = serde_json::from_str(&json).unwrap();
    let states: Vec<&str> = s["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["state"].as_str().unwrap())
        .collect();
    assert_eq!(
        states,
        ["running", "running", "waiting", "waiting"],
        "{json}"
    );
}

/// Pod 2's worker fails at every start while pods 0 and 1 are fine (their workers fail
/// only because pod 2's did): after three such rounds pod 2's machine is quarantined, its
/// agent exits 80, the other two train on as a group of 2, and an agent started again on
/// the same machine exits 80 at once.
#[test]
fn a_node_that_fails_first_round_after_round_is_quarantined() {
    let mut job = Job::new("quarantine", "2:3", 10, 1_000_000, 25);
    job.rdzv_conf = "last_call_timeout=1".into();
    let w = worker(
        &job,
        "tests/py/elastic_worker.py",
        &["1000000", "--fail-on", "pod2"],
    );
    let pods: Vec<_> = (0..2).map(|i| job.pod_running(i, 1, &[], &w)).collect();
    let mut bad = job.pod_running(2, 1, &[], &w);
    assert_eq!(bad.wait(LIMIT), 80, "{}", bad.output());
    let err = bad.stderr();
    assert!(
        err.contains("quarantining this machine")
            && err.contains("came from node pod2-")
            && err.contains("while the others were fine"),
        "{err}"
    );
    for p in &pods {
        assert!(!p.stderr().contains("quarantining"), "{}", p.stderr());
    }
    pod2_stays_out(&job, &pods, &[], &w);
}

/// After pod 2's machine was quarantined: the other two train on as a group of 2, status
/// lists the quarantine, and an agent started again on pod 2's machine (with `flags`)
/// exits 80 at once.
fn pod2_stays_out(job: &Job, pods: &[fsdp_tests::pod::Pod], flags: &[&str], w: &[String]) {
    let all: Vec<&fsdp_tests::pod::Pod> = pods.iter().collect();
    fsdp_tests::job::wait_until("a group of 2 without pod 2", &all, || {
        pods.iter().all(|p| {
            fsdp_tests::job::starts(p)
                .last()
                .is_some_and(|s| s.world == 2)
        })
    });
    job.progresses(3, &all);
    let (_, table, _) = status_cmd(&["--rdzv-endpoint", &job.endpoint(), "--rdzv-id", &job.run_id]);
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("quarantined") && l.contains("pod2 (for ")),
        "{table}"
    );
    let mut again = job.pod_running(2, 1, flags, w);
    assert_eq!(again.wait(LIMIT), 80, "{}", again.output());
    assert!(
        again.stderr().contains("this machine is quarantined"),
        "{}",
        again.stderr()
    );
    assert!(fsdp_tests::job::starts(&again).is_empty());
}

/// Pod 2's worker exits 3, a code `--quarantine-on-exit` marks as the machine's fault: after
/// that one attempt pod 2's machine is quarantined and its agent exits 80, the other two
/// train on as a group of 2, and an agent started again on the same machine exits 80 at
/// once. `--quarantine-after 0`: no blame, this rule alone.
#[test]
fn a_quarantine_exit_code_keeps_the_machine_out_after_one_attempt() {
    let mut job = Job::new("quarantine-code", "2:3", 10, 1_000_000, 27);
    job.rdzv_conf = "last_call_timeout=1".into();
    let w = worker(
        &job,
        "tests/py/elastic_worker.py",
        &["1000000", "--fail-on", "pod2"],
    );
    let flags = ["--quarantine-on-exit", "3", "--quarantine-after", "0"];
    let pods: Vec<_> = (0..2).map(|i| job.pod_running(i, 1, &flags, &w)).collect();
    let mut bad = job.pod_running(2, 1, &flags, &w);
    assert_eq!(bad.wait(LIMIT), 80, "{}", bad.output());
    assert_eq!(fsdp_tests::job::starts(&bad).len(), 1, "{}", bad.output());
    let err = bad.stderr();
    assert!(
        err.contains("quarantining this machine") && err.contains("--quarantine-on-exit"),
        "{err}"
    );
    pod2_stays_out(&job, &pods, &flags, &w);
}

/// A SIGKILLed pod makes the survivors' workers fail; one of them reports first. With
/// `--quarantine-after 1` nobody is blamed for it: the round lost a member.
#[test]
fn a_peers_death_is_never_blamed_on_a_survivor() {
    let mut job = Job::new("nokillblame", "2:3", 3, 1_000_000, 26);
    job.rdzv_conf = "last_call_timeout=1".into();
    let w = worker(&job, "tests/py/elastic_worker.py", &["1000000"]);
    let mut pods: Vec<_> = (0..3)
        .map(|i| job.pod_running(i, 1, &["--quarantine-after", "1"], &w))
        .collect();
    {
        let all: Vec<&fsdp_tests::pod::Pod> = pods.iter().collect();
        fsdp_tests::job::wait_until("a group of 3", &all, || {
            pods.iter()
                .all(|p| fsdp_tests::job::nth_start_world(p, 0, 3))
        });
        job.progresses(3, &all);
    }
    pods[2].kill();
    let survivors: Vec<&fsdp_tests::pod::Pod> = pods[..2].iter().collect();
    fsdp_tests::job::wait_until("a group of 2", &survivors, || {
        pods[..2].iter().all(|p| {
            fsdp_tests::job::starts(p)
                .last()
                .is_some_and(|s| s.world == 2)
        })
    });
    job.progresses(3, &survivors);
    for p in &mut pods[..2] {
        assert_eq!(p.exited(), None, "{}", p.output());
        assert!(!p.stderr().contains("quarantining"), "{}", p.stderr());
    }
}
