//! Hangs: real PyTorch gloo workers that report progress through
//! `examples/progress.py`; one of them stalls.

use std::path::{Path, PathBuf};
use std::time::Duration;

use fsdp_tests::{AgentCmd, TempDir, python, workspace_file};

const LIMIT: Duration = Duration::from_secs(180);

/// Every file under `dir` called `name`.
fn find(dir: &Path, name: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = entry.path();
        if p.is_dir() {
            out.extend(find(&p, name));
        } else if p.file_name().is_some_and(|n| n == name) {
            out.push(p);
        }
    }
    out
}

/// `2026-11-25T02:32:12.273482Z` as seconds since the epoch (UTC, no leap seconds).
fn chrono_like_epoch(stamp: &str) -> Option<f64> {
    let (date, time) = stamp.trim_end_matches('Z').split_once('T')?;
    let mut d = date.split('-').map(|x| x.parse::<i64>());
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    // Days from 1970-01-01 to y-m-d (Howard Hinnant's civil-from-days, inverted).
    let (y, m) = if m <= 2 { (y - 1, m + 9) } else { (y, m - 3) };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * m + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let mut t = time.split(':');
    let (h, min, s): (f64, f64, f64) = (
        t.next()?.parse().ok()?,
        t.next()?.parse().ok()?,
        t.next()?.parse().ok()?,
    );
    Some(days as f64 * 86_400.0 + h * 3600.0 + min * 60.0 + s)
}

/// The step each worker of the first restart resumed at, from its `start` line.
fn resumed_steps(out: &str) -> Vec<u32> {
    out.lines()
        .filter(|l| l.contains("restart=1"))
        .filter_map(|l| {
            l.split("step=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

fn hang_worker(dir: &Path, agent_args: &[&str], worker_args: &[&str]) -> fsdp_tests::Agent {
    hang_worker_env(dir, &[], agent_args, worker_args)
}

fn hang_worker_env(
    dir: &Path,
    env: &[(&str, &str)],
    agent_args: &[&str],
    worker_args: &[&str],
) -> fsdp_tests::Agent {
    let ckpt = dir.join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    let mut cmd = AgentCmd::new(dir, "agent");
    for (k, v) in env {
        cmd = cmd.env(k, v);
    }
    cmd.env("PYTHON", python())
        .args(fsdp_tests::WHOLE_LINES)
        .args(["--standalone", "--nproc-per-node", "2", "--log-dir"])
        .arg_path(dir.join("logs"))
        .args(agent_args)
        .arg_path(workspace_file("tests/py/hang_worker.py"))
        .arg_path(&ckpt)
        .args(worker_args)
        .run(LIMIT)
}

/// A rank stalls after step 10 (steps of 0.2 s, automatic timeout with a 2 s floor): the
/// agent finds the group hung within the allowance, names the rank behind, dumps where
/// each worker is (the stalled one in `stall_forever`), and restarts the group, which
/// resumes from its checkpoint and finishes.
#[test]
fn a_stalled_rank_is_found_named_dumped_and_the_group_restarts_from_its_checkpoint() {
    let dir = TempDir::new().unwrap();
    let mut a = hang_worker(
        dir.path(),
        &["--hang-min", "2", "--max-restarts", "1"],
        &["30", "10", "1"],
    );
    let (out, err) = (a.stdout(), a.stderr());
    assert_eq!(a.code(), 0, "{}", a.output());
    assert!(err.contains("the worker group is hung"), "{err}");
    assert!(
        err.contains("behind it: rank 1"),
        "the stalled rank is not named\n{err}"
    );
    let dumps = find(&dir.path().join("logs"), "hang_rank1.txt");
    assert_eq!(dumps.len(), 1, "{err}");
    let dump = std::fs::read_to_string(&dumps[0]).unwrap();
    // py-spy (installed by the set-up) shows the Python frame; where it cannot attach
    // (no ptrace in a container), the kernel's view of every thread stands in.
    if dump.starts_with("the kernel's view") {
        assert!(dump.contains("wchan="), "{dump}");
    } else {
        assert!(dump.contains("stall_forever"), "{dump}");
    }
    // Found by the automatic timeout that followed the 0.2 s steps (documented bound:
    // the 2 s floor plus at most 1 s to the next look), not by the 600 s start-up
    // allowance or a collective timeout: checked loosely, a busy machine is slower.
    let stalled: f64 = out
        .lines()
        .find_map(|l| {
            l.split("stall rank=1")
                .nth(1)?
                .split("t=")
                .nth(1)?
                .trim()
                .parse()
                .ok()
        })
        .expect("the stall's time");
    let found = err
        .lines()
        .find(|l| l.contains("the worker group is hung"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(chrono_like_epoch)
        .expect("the hang's time");
    assert!(
        found - stalled < 10.0,
        "found {:.1} s after the stall\n{err}",
        found - stalled
    );
    // The restart resumed from the checkpoint, not from zero.
    let resumed = resumed_steps(&out);
    assert!(
        resumed.len() == 2 && resumed.iter().all(|&s| s >= 9),
        "{out}"
    );
}

/// A checkpoint that takes longer than the automatic allowance (3 s against 10 × 0.2 s),
/// reported as a phase: no hang.
#[test]
fn a_long_reported_phase_is_not_a_hang() {
    let dir = TempDir::new().unwrap();
    let mut a = hang_worker(
        dir.path(),
        &["--hang-min", "0.5", "--max-restarts", "0"],
        &["12", "0", "9", "5"],
    );
    assert_eq!(a.code(), 0, "{}", a.output());
    assert!(!a.stderr().contains("hung"), "{}", a.output());
}

/// A long final save after the last step, not reported as a phase, on one rank while the
/// other has already exited 0: the group is finishing, not hung (the time after a worker
/// succeeded is judged by the finish allowance, not as a step).
#[test]
fn a_slow_end_after_another_worker_succeeded_is_not_a_hang() {
    let dir = TempDir::new().unwrap();
    let mut a = hang_worker_env(
        dir.path(),
        &[("FINAL_SAVE", "1:5")],
        &["--hang-min", "0.5", "--max-restarts", "0"],
        &["12", "0", "9"],
    );
    assert_eq!(a.code(), 0, "{}", a.output());
    assert!(!a.stderr().contains("hung"), "{}", a.output());
}

/// torchrun's file timer with PyTorch's own client: the scope that expires gets its
/// worker SIGKILLed (the client's default signal), as under torchrun, and the group
/// restarts within the budget and finishes.
#[test]
fn an_expired_file_timer_scope_kills_its_worker_and_the_group_restarts() {
    let dir = TempDir::new().unwrap();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .env("PYTHON", python())
        .env("TORCHELASTIC_ENABLE_FILE_TIMER", "1")
        .args([
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
        ])
        .arg_path(workspace_file("tests/py/timer_worker.py"))
        .run(LIMIT);
    let (out, err) = (a.stdout(), a.stderr());
    assert_eq!(a.code(), 0, "{}", a.output());
    assert!(
        err.contains("a file-timer scope expired; signalling its worker"),
        "{err}"
    );
    assert!(
        err.contains("signal 9 (SIGKILL)"),
        "the worker died of the scope's signal\n{err}"
    );
    assert_eq!(out.matches("done rank=").count(), 2, "{out}");
    assert!(out.contains("restart=1"), "{out}");
}

#[test]
fn log_timestamps_read_as_epoch_seconds() {
    let t = chrono_like_epoch("2026-11-25T02:32:12.273482Z").unwrap();
    assert!((t - 1_795_573_932.273_482).abs() < 1e-3, "{t}");
    assert_eq!(chrono_like_epoch("1970-01-01T00:00:00Z"), Some(0.0));
}

/// A 2:2 job on etcd (`--max-restarts 1`) and its pods' worker: `hang_worker.py` with the
/// job's checkpoint directory and `args` (total steps, stall step, stalling rank).
fn two_nodes(
    run: &str,
    net: u8,
    rdzv_conf: &str,
    args: [&str; 3],
) -> (fsdp_tests::job::Job, Vec<String>) {
    let mut job = fsdp_tests::job::Job::new(run, "2:2", 1, 0, net);
    job.rdzv_conf = rdzv_conf.into();
    let ckpt = job.dir.path().join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    let mut worker = vec![
        workspace_file("tests/py/hang_worker.py")
            .display()
            .to_string(),
        ckpt.display().to_string(),
    ];
    worker.extend(args.iter().map(|a| (*a).to_owned()));
    (job, worker)
}

/// Two nodes × two ranks on etcd; rank 3 (node 1) stalls after step 10. Every node's
/// workers stop progressing, the hang is found, the failure is charged job-wide, every
/// node publishes where its ranks were, the node that declared the hang names rank 3 on
/// node 1 as the one behind, and both nodes restart from the checkpoint with the same
/// restart count and finish.
#[test]
fn a_stall_on_one_node_is_named_across_nodes_and_both_restart_from_the_checkpoint() {
    let (job, worker) = two_nodes(
        "hang2",
        18,
        "last_call_timeout=1,keep_alive_ttl=3",
        ["30", "10", "3"],
    );
    let mut pods: Vec<_> = (0..2)
        .map(|i| {
            // Four ranks over two nodes share two cores with the rest of the suite: after
            // their last step, tearing down gloo and torch can take seconds, which a 2 s
            // allowance took for a second hang (and spent the budget).
            let mut extra = vec!["--hang-min", "4"];
            extra.extend(fsdp_tests::WHOLE_LINES);
            job.pod_running(i, 2, &extra, &worker)
        })
        .collect();
    for p in &mut pods {
        assert_eq!(p.wait(LIMIT), 0, "{}", p.output());
    }
    let errs: Vec<String> = pods.iter().map(|p| p.stderr()).collect();
    let declared: Vec<&String> = errs
        .iter()
        .filter(|e| e.contains("the worker group is hung"))
        .collect();
    assert!(!declared.is_empty(), "{}", errs.join("\n"));
    // Ranks follow the join order: rank 3 is on whichever pod joined second. Node ids
    // are "<host>-<pid>-<suffix>", and a pod's host name is its own.
    let host = pods
        .iter()
        .position(|p| p.stdout().contains("stall rank=3"))
        .map(|i| format!("rank 3 on node pod{i}-"))
        .expect("the pod of the stalled rank");
    for e in declared {
        // Locally, a node sees either its own rank behind or that it is elsewhere...
        assert!(
            e.contains("behind it: rank 3") || e.contains("the rank behind is on another node"),
            "{e}"
        );
        // ...and across nodes, every declaring node names the rank and its node.
        let culprit = e
            .lines()
            .find(|l| l.contains("the hang's culprit"))
            .unwrap_or_else(|| panic!("no culprit named\n{}", errs.join("\n")));
        assert!(
            culprit.contains(&host)
                && culprit.contains("last finished step 9; all others finished step 10"),
            "{culprit}"
        );
    }
    // The records stay in etcd: `fsdp-agent status` says who the last hang points at.
    let (_, table, _) =
        fsdp_tests::status_cmd(&["--rdzv-endpoint", &job.endpoint(), "--rdzv-id", &job.run_id]);
    let last = table
        .lines()
        .find(|l| l.starts_with("last hang"))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(
        last.contains("round 0: ") && last.contains(&host) && last.contains("last finished step 9"),
        "{table}"
    );
    for p in &pods {
        let out = p.stdout();
        let resumed = resumed_steps(&out);
        assert!(
            resumed.len() == 2 && resumed.iter().all(|&s| s >= 9),
            "{}",
            p.output()
        );
    }
}

/// `fsdp-agent status` shows the straggler view while a job runs: every reporting rank of
/// the round, asked from its agent, with its node and its last step's time (0.2 s steps).
#[test]
fn status_shows_the_slowest_ranks_of_a_running_job() {
    let (job, worker) = two_nodes("slow2", 19, "last_call_timeout=1", ["60", "0", "99"]);
    let mut pods: Vec<_> = (0..2)
        .map(|i| job.pod_running(i, 2, &fsdp_tests::WHOLE_LINES, &worker))
        .collect();
    let refs: Vec<&fsdp_tests::pod::Pod> = pods.iter().collect();
    job.progresses(5, &refs);
    let endpoint = job.endpoint();
    // The agents refresh what they show once a second, and a step time needs two steps:
    // ask until every rank has one.
    let end = std::time::Instant::now() + Duration::from_secs(30);
    let (table, view) = loop {
        let (code, table, err) =
            fsdp_tests::status_cmd(&["--rdzv-endpoint", &endpoint, "--rdzv-id", &job.run_id]);
        assert_eq!(code, 0, "{err}");
        let view: Vec<Vec<String>> = table
            .lines()
            .skip_while(|l| !l.starts_with("slowest ranks"))
            .skip(2)
            .map(|l| l.split_whitespace().map(str::to_owned).collect())
            .collect();
        let timed = |cells: &Vec<String>| cells[3] != "0.000s";
        if view.len() == 4 && view.iter().all(timed) {
            break (table, view);
        }
        assert!(std::time::Instant::now() < end, "{table}");
        std::thread::sleep(Duration::from_millis(300));
    };
    let mut ranks: Vec<u32> = Vec::new();
    for cells in &view {
        ranks.push(cells[0].parse().unwrap());
        assert!(
            cells[1].starts_with("pod0-") || cells[1].starts_with("pod1-"),
            "{table}"
        );
        let step_time: f64 = cells[3].trim_end_matches('s').parse().unwrap();
        assert!((0.1..5.0).contains(&step_time), "{table}");
    }
    ranks.sort_unstable();
    assert_eq!(ranks, [0, 1, 2, 3], "{table}");
    let (_, json, _) = fsdp_tests::status_cmd(&[
        "--json",
        "--rdzv-endpoint",
        &endpoint,
        "--rdzv-id",
        &job.run_id,
    ]);
    let j: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(
        j["slowest_ranks"].as_array().map(Vec::len),
        Some(4),
        "{json}"
    );
    for p in &mut pods {
        assert_eq!(p.wait(LIMIT), 0, "{}", p.output());
    }
}
