//! Stragglers, for real: agents on a real etcd whose workers do a fixed amount of CPU work
//! per step and report their working time; one node's worker is slowed by the kernel (a
//! CPU cgroup's quota: 5% of a core), not by a flag in the worker. The group's rank 0
//! names it; with `--straggler-policy replace` it is taken out (quarantined, exit 80) and
//! the spare takes its place; with `warn` nothing is taken out.
//!
//! Every other test's agents are checked never to name a straggler (`fsdp_tests::Agent`'s
//! drop): the loaded suite is the noise test.

use std::path::{Path, PathBuf};
use std::time::Duration;

use fsdp_tests::etcd::Etcd;
use fsdp_tests::{Agent, AgentCmd, TempDir, status_cmd, wait_for, wait_showing, workspace_file};

const LIMIT: Duration = Duration::from_secs(90);

/// ~10 ms of CPU work a step, then 40 ms away from the CPU (the collective's wait): a
/// healthy worker uses a fifth of a core, so the machine's load cannot make it look slow
/// the way a 5% quota does (20 times).
const WORKER: &str = r#"
import sys, time
sys.path.insert(0, sys.argv[1])
from progress import step
n = 0
while True:
    t = time.monotonic()
    x = 0
    for i in range(100_000):
        x += i
    n += 1
    step(n, time.monotonic() - t)
    time.sleep(0.04)
"#;

/// A CPU cgroup holding one process at `percent` of a core (cgroup v1's cpu controller,
/// or v2's `cpu.max`); removed when dropped (its process is gone by then).
struct Slowed(PathBuf);

impl Slowed {
    fn pid(pid: i32, percent: u32) -> Self {
        let name = format!("fsdp-test-straggler-{}-{pid}", std::process::id());
        let period = 20_000u32;
        let quota = (period * percent / 100).max(1_000);
        let v1 = Path::new("/sys/fs/cgroup/cpu");
        let dir = if v1.join("cpu.cfs_quota_us").exists() {
            let dir = v1.join(&name);
            std::fs::create_dir_all(&dir).expect("a cgroup (needs root, as CI has)");
            std::fs::write(dir.join("cpu.cfs_period_us"), period.to_string()).unwrap();
            std::fs::write(dir.join("cpu.cfs_quota_us"), quota.to_string()).unwrap();
            dir
        } else {
            let root = Path::new("/sys/fs/cgroup");
            // cgroup v2: the cpu controller must be on for the root's children.
            let _ = std::fs::write(root.join("cgroup.subtree_control"), "+cpu");
            let dir = root.join(&name);
            std::fs::create_dir_all(&dir).expect("a cgroup (needs root, as CI has)");
            std::fs::write(dir.join("cpu.max"), format!("{quota} {period}")).unwrap_or_else(|e| {
                panic!(
                    "no cpu controller in cgroup v2 here ({e}): this test slows a worker with one"
                )
            });
            dir
        };
        std::fs::write(dir.join("cgroup.procs"), pid.to_string()).expect("move the worker");
        Self(dir)
    }
}

impl Drop for Slowed {
    fn drop(&mut self) {
        // Its process may still run (the agents are dropped after this): back to the
        // parent cgroup, or the directory could not be removed.
        let parent = self.0.parent().unwrap().join("cgroup.procs");
        let procs = std::fs::read_to_string(self.0.join("cgroup.procs")).unwrap_or_default();
        for pid in procs.lines() {
            let _ = std::fs::write(&parent, pid);
        }
        for _ in 0..100 {
            if std::fs::remove_dir(&self.0).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn agent(dir: &Path, etcd: &Etcd, name: &str, nnodes: &str, policy: &str) -> Agent {
    // One script for all (it is part of the job), replaced whole: rewriting it in place
    // while another agent's python opens it runs an empty file, a worker that "finishes"
    // at once (seen under load when the spare was started right after the group's
    // workers).
    let script = dir.join("worker.py");
    let fresh = dir.join(format!("worker.py.{name}"));
    std::fs::write(&fresh, WORKER).unwrap();
    std::fs::rename(&fresh, &script).unwrap();
    AgentCmd::new(dir, name)
        .naming_stragglers()
        .args([
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "0",
        ])
        .args([
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            &etcd.endpoint(),
        ])
        .args(["--rdzv-id", "stragglers", "--local-addr", "127.0.0.1"])
        .args(["--rdzv-conf", "last_call_timeout=1"])
        // Each agent its own machine: a quarantine keeps out a machine.
        .args(["--node-name", &format!("machine-{name}")])
        .args(["--straggler-policy", policy, "--quarantine-for", "10m"])
        .args(["--no-python", "python3"])
        .arg_path(&script)
        .arg_path(workspace_file("examples"))
        .spawn()
}

/// A value `key=...` of the last log line that contains `what`.
fn last_value(a: &Agent, what: &str, key: &str) -> Option<String> {
    let err = a.stderr();
    let line = err.lines().rev().find(|l| l.contains(what))?;
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .map(|v| v.trim_matches('"').to_owned())
}

/// Waits until every agent's last group is `world` nodes; returns their node ids.
fn formed(agents: &[&Agent], world: usize) -> Vec<String> {
    let want = world.to_string();
    wait_for("the group formed", LIMIT, || {
        agents.iter().all(|a| {
            last_value(a, "group formed", "group_world_size").as_deref() == Some(&want)
                && a.stderr().matches("workers started").count()
                    == a.stderr().matches("group formed").count()
        })
    });
    agents
        .iter()
        .map(|a| last_value(a, "joined the rendezvous", "node_id").expect("node_id"))
        .collect()
}

/// The agent of group rank `rank` in its last group.
fn with_rank<'a>(agents: &[&'a Agent], rank: u32) -> &'a Agent {
    agents
        .iter()
        .find(|a| last_value(a, "group formed", "group_rank") == Some(rank.to_string()))
        .expect("an agent of that rank")
}

/// The pid of the agent's current worker (its last "workers started" line).
fn worker_pid(a: &Agent) -> i32 {
    let err = a.stderr();
    let line = err
        .lines()
        .rev()
        .find(|l| l.contains("workers started"))
        .expect("workers started");
    let pids = line.split("pids=[").nth(1).expect("pids=[");
    pids.split([']', ','])
        .next()
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn a_slowed_node_is_named_taken_out_and_the_spare_takes_its_place() {
    let etcd = Etcd::start();
    let dir = TempDir::new().unwrap();
    let a: Vec<Agent> = (0..3)
        .map(|i| agent(dir.path(), &etcd, &format!("n{i}"), "2:3", "replace"))
        .collect();
    let all: Vec<&Agent> = a.iter().collect();
    let ids = formed(&all, 3);
    // The spare waits: the group is at its maximum.
    let mut spare = agent(dir.path(), &etcd, "spare", "2:3", "replace");
    let judge = with_rank(&all, 0).pid();
    let slow = with_rank(&all, 2).pid();
    let mut a = a;
    let slow = a.remove(a.iter().position(|x| x.pid() == slow).unwrap());
    let judge = a.iter().find(|x| x.pid() == judge).unwrap();
    let slow_id = last_value(&slow, "joined the rendezvous", "node_id").unwrap();
    let _slowed = Slowed::pid(worker_pid(&slow), 5);

    let named = format!("a straggler: node {slow_id}: rank 2 works");
    wait_showing(
        "the judge to name the slowed node",
        LIMIT,
        || judge.stderr().contains(&named),
        || {
            let shown: Vec<String> = a.iter().chain([&slow]).map(Agent::output).collect();
            shown.join("\n")
        },
    );
    // Taken out after the bound: quarantined, exit 80, the judge's words in its log.
    let mut slow = slow;
    assert_eq!(slow.wait(LIMIT).code(), Some(80), "{}", slow.output());
    let err = slow.stderr();
    assert!(
        err.contains("this machine was quarantined") && err.contains("straggler: node"),
        "{err}"
    );
    // The spare takes its place: a group of three again, the slowed node not in it.
    wait_for("the spare in the group", LIMIT, || {
        last_value(&spare, "group formed", "group_world_size").as_deref() == Some("3")
            && spare.stderr().contains("workers started")
    });
    let (code, out, _) = status_cmd(&[
        "--rdzv-endpoint",
        &etcd.endpoint(),
        "--rdzv-id",
        "stragglers",
    ]);
    assert_eq!(code, 0, "{out}");
    let left = out
        .lines()
        .skip_while(|l| !l.starts_with("left"))
        .find(|l| l.contains(&slow_id))
        .unwrap_or_default();
    assert!(
        left.contains("quarantined") && left.contains("straggler"),
        "{out}"
    );
    assert!(out.contains("quarantined  machine-n"), "{out}");
    assert!(ids.contains(&slow_id));
    // The others kept running throughout: only the slowed node left.
    for x in &a {
        assert!(fsdp_tests::alive(x.pid()), "{}", x.output());
    }
    spare.signal(libc::SIGTERM);
    let _ = spare.wait(LIMIT);
}

#[test]
fn with_warn_a_slowed_node_is_named_and_nothing_is_taken_out() {
    let etcd = Etcd::start();
    let dir = TempDir::new().unwrap();
    let a: Vec<Agent> = (0..3)
        .map(|i| agent(dir.path(), &etcd, &format!("n{i}"), "2:3", "warn"))
        .collect();
    let all: Vec<&Agent> = a.iter().collect();
    formed(&all, 3);
    let rounds: Vec<usize> = a
        .iter()
        .map(|x| x.stderr().matches("group formed").count())
        .collect();
    let judge = with_rank(&all, 0);
    let slow = with_rank(&all, 1);
    let slow_id = last_value(slow, "joined the rendezvous", "node_id").unwrap();
    let _slowed = Slowed::pid(worker_pid(slow), 5);
    wait_for("the judge to name the slowed node", LIMIT, || {
        judge
            .stderr()
            .contains(&format!("a straggler: node {slow_id}: rank 1 works"))
    });
    // Status shows it judged a straggler, and the judge's metrics say so.
    let (code, out, _) = status_cmd(&[
        "--rdzv-endpoint",
        &etcd.endpoint(),
        "--rdzv-id",
        "stragglers",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}");
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    let named: Vec<&serde_json::Value> = j["stragglers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["straggler"] == true)
        .collect();
    assert_eq!(named.len(), 1, "{out}");
    assert_eq!(named[0]["node_id"], slow_id.as_str(), "{out}");
    // Past replace's bound (20 s) and a look more: every node still runs the same round.
    std::thread::sleep(Duration::from_secs(30));
    for (x, before) in a.iter().zip(rounds) {
        assert!(fsdp_tests::alive(x.pid()), "{}", x.output());
        let now = x.stderr().matches("group formed").count();
        assert_eq!(now, before, "{}", x.output());
    }
}
