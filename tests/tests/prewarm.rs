//! `--prewarm`: workers started from spare interpreters that imported torch ahead must be
//! indistinguishable from cold ones except for speed, re-form and restart warm, fall back
//! to a cold start when their spare is gone, and never outlive the agent.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use fsdp_tests::job::{Job, LIMIT, nth_start_world, starts, wait_until};
use fsdp_tests::{AgentCmd, TempDir, alive, python, wait_for};

/// Dumps what a worker can observe of how it was started into `<out>/<RANK>.json`.
const DUMP: &str = r#"
import ctypes, json, os, signal, stat, sys
import torch
try:
    import sibling  # a script: its directory is sys.path[0]
except ImportError:
    try:
        from pkg import sibling  # a module: the working directory is
    except ImportError:
        sibling = None  # --run-path: the launcher's directory is
libc = ctypes.CDLL(None, use_errno=True)
pdeathsig = ctypes.c_int(0)
libc.prctl(2, ctypes.byref(pdeathsig), 0, 0, 0)  # PR_GET_PDEATHSIG
st0 = os.fstat(0)
g = globals()
d = {
    "argv": sys.argv,
    "orig_argv": sys.orig_argv[1:],
    "path0": sys.path[0],
    "name": __name__,
    "file": g.get("__file__"),
    "main_keys": sorted(k for k in g if k.startswith("__")),
    "loader": type(g.get("__loader__")).__name__,
    "spec": getattr(__spec__, "name", None),
    "main_is_this": sys.modules["__main__"].__dict__ is g,
    "cwd": os.getcwd(),
    "env": dict(os.environ),
    "stdin": [stat.S_IFMT(st0.st_mode), st0.st_dev, st0.st_ino],
    "stdout_is_pipe_or_file": not os.isatty(1),
    "signals": {s.name: str(signal.getsignal(s)) for s in signal.Signals
                if s not in (signal.SIGKILL, signal.SIGSTOP)},
    "session_leader": os.getsid(0) == os.getpid(),
    "group_leader": os.getpgid(0) == os.getpid(),
    "pdeathsig": pdeathsig.value,
    "sibling": getattr(sibling, "VALUE", None),
    "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")),
}
out = os.environ["DUMP_DIR"]
with open(os.path.join(out, os.environ["RANK"] + ".json"), "w") as f:
    json.dump(d, f)
print("dumped rank", os.environ["RANK"], flush=True)
code = int(os.environ.get("DUMP_EXIT", "0"))
if code == 99:
    raise ValueError("a worker's own error")
sys.exit(code)
"#;

/// Variables that differ between any two runs, warm or cold.
const PER_RUN: &[&str] = &[
    "TORCHELASTIC_RUN_ID",
    "MASTER_PORT",
    "FSDP_AGENT_PROGRESS",
    "FSDP_AGENT_CONTROL",
    "TORCHELASTIC_ERROR_FILE",
    "DUMP_DIR",
];

/// A project with the dump as a script (`pkg/dump.py`, importing its sibling) and as a
/// module (`-m pkg.dump` from the project's directory).
fn project(dir: &Path) -> PathBuf {
    let pkg = dir.join("proj/pkg");
    std::fs::create_dir_all(&pkg).unwrap();
    std::fs::write(pkg.join("__init__.py"), "").unwrap();
    std::fs::write(pkg.join("dump.py"), DUMP).unwrap();
    std::fs::write(pkg.join("sibling.py"), "VALUE = 'next to the script'\n").unwrap();
    dir.join("proj")
}

/// Runs the agent in `cwd` on `entry` (2 workers), cold or `--prewarm`, and returns each
/// rank's dump, the agent's exit code and its output.
fn run(
    dir: &Path,
    cwd: &Path,
    name: &str,
    warm: bool,
    entry: &[&str],
    exit: &str,
) -> (Vec<serde_json::Value>, i32, String) {
    let out = dir.join(name);
    std::fs::create_dir_all(&out).unwrap();
    let mut args = vec![
        "--standalone".to_owned(),
        "--nproc-per-node".into(),
        "2".into(),
        "--log-dir".into(),
        dir.join(format!("{name}-logs")).display().to_string(),
        "--tee".into(),
        "1".into(),
    ];
    if warm {
        args.push("--prewarm".into());
    }
    args.extend(entry.iter().map(|s| s.to_string()));
    let mut agent = AgentCmd::new(dir, name)
        .args(&args)
        .env("PYTHON", python())
        .env("DUMP_DIR", &out)
        .env("DUMP_EXIT", exit)
        .current_dir(cwd)
        .run(LIMIT);
    let code = agent.code();
    let dumps = (0..2)
        .map(|r| {
            let text = std::fs::read_to_string(out.join(format!("{r}.json"))).unwrap_or_else(|e| {
                panic!("{name}: rank {r} wrote no dump ({e})\n{}", agent.output())
            });
            serde_json::from_str(&text).unwrap()
        })
        .collect();
    (dumps, code, agent.output())
}

fn assert_same(cold: &[serde_json::Value], warm: &[serde_json::Value], what: &str) {
    for (rank, (c, w)) in cold.iter().zip(warm).enumerate() {
        let (c, w) = (c.as_object().unwrap(), w.as_object().unwrap());
        for (k, cv) in c {
            if k == "env" {
                let (ce, we) = (cv.as_object().unwrap(), w["env"].as_object().unwrap());
                let keys: std::collections::BTreeSet<&String> =
                    ce.keys().chain(we.keys()).collect();
                for key in keys.into_iter().filter(|k| !PER_RUN.contains(&k.as_str())) {
                    assert_eq!(ce.get(key), we.get(key), "{what}, rank {rank}: ${key}");
                }
            } else {
                assert_eq!(Some(cv), w.get(k), "{what}, rank {rank}: {k}");
            }
        }
    }
}

fn warm_starts(output: &str) -> usize {
    output.matches("worker started from its spare").count()
}

#[test]
fn a_warm_worker_sees_exactly_what_a_cold_one_sees_as_a_script_and_as_a_module() {
    let dir = TempDir::new().unwrap();
    let proj = project(dir.path());
    for (what, entry) in [
        ("a script", vec!["pkg/dump.py", "x", "--lr", "3e-4"]),
        ("a module", vec!["-m", "pkg.dump", "--flag"]),
        // torchrun's --run-path: `python -c <runpy snippet>`, so the spare's `-c` path.
        ("run-path", vec!["--run-path", "pkg/dump.py", "y"]),
    ] {
        let tag = what.replace(' ', "-");
        let (cold, cold_code, cold_out) = run(
            dir.path(),
            &proj,
            &format!("{tag}-cold"),
            false,
            &entry,
            "0",
        );
        let (warm, warm_code, warm_out) =
            run(dir.path(), &proj, &format!("{tag}-warm"), true, &entry, "0");
        assert_eq!(warm_starts(&cold_out), 0, "{cold_out}");
        assert_eq!(warm_starts(&warm_out), 2, "both workers warm\n{warm_out}");
        assert_eq!((cold_code, warm_code), (0, 0), "{warm_out}");
        assert_same(&cold, &warm, what);
        // Output goes through the same prefixes and log files.
        for r in 0..2 {
            assert!(
                warm_out.contains(&format!("[default{r}]:dumped rank {r}")),
                "{warm_out}"
            );
        }
        if what != "run-path" {
            assert_eq!(
                warm[0]["sibling"], "next to the script",
                "{what}: the script's directory is sys.path[0]"
            );
        }
    }
}

#[test]
fn exit_codes_and_error_files_are_the_workers_own() {
    let dir = TempDir::new().unwrap();
    let proj = project(dir.path());
    let entry = ["pkg/dump.py"];
    let (_, cold_code, _) = run(dir.path(), &proj, "exit-cold", false, &entry, "7");
    let (_, warm_code, warm_out) = run(dir.path(), &proj, "exit-warm", true, &entry, "7");
    assert_eq!((cold_code, warm_code), (7, 7), "{warm_out}");
    // An uncaught exception: exit 1 and a traceback that starts at the worker's own code.
    let (_, code, out) = run(dir.path(), &proj, "raise-warm", true, &entry, "99");
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("ValueError: a worker's own error"), "{out}");
    assert!(
        !out.contains("fsdp-agent spare"),
        "the spare's frames are not shown\n{out}"
    );

    // @record writes the error file from the worker, warm as cold, and the agent reads
    // the root cause from it.
    let script = fsdp_tests::workspace_file("tests/py/raise_with_record.py");
    let mut agent = AgentCmd::new(dir.path(), "record-warm")
        .args(["--standalone", "--nproc-per-node", "2", "--prewarm"])
        .arg_path(&script)
        .env("PYTHON", python())
        .run(LIMIT);
    assert_eq!(agent.code(), 1, "{}", agent.output());
    let err = agent.stderr();
    assert_eq!(warm_starts(&err), 2, "{err}");
    assert!(
        err.contains("Root cause (first observed failure):\n  rank 1 (local_rank 1"),
        "{err}"
    );
    assert!(
        err.contains("message: ValueError: deliberate failure on local rank 1"),
        "{err}"
    );
}

/// The pids of `agent`'s children that are spare interpreters (their command line names
/// the spare's launcher), minus `except`.
fn spares_of(agent: i32, except: &[i32]) -> Vec<i32> {
    let children =
        std::fs::read_to_string(format!("/proc/{agent}/task/{agent}/children")).unwrap_or_default();
    children
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .filter(|p| !except.contains(p))
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains("fsdp_agent_spare"))
        })
        .collect()
}

/// The current workers' pids, from the agent's last "workers started pids=[..]" line
/// (this test's agents share our PID namespace).
fn worker_pids(agent_log: &str) -> Vec<i32> {
    agent_log
        .lines()
        .rev()
        .find_map(|l| l.split_once("workers started pids=[").map(|(_, rest)| rest))
        .and_then(|rest| rest.split_once(']'))
        .map(|(pids, _)| pids.split(", ").filter_map(|p| p.parse().ok()).collect())
        .unwrap_or_default()
}

#[test]
fn a_killed_spare_means_a_cold_start_that_says_why_and_no_spare_outlives_the_agent() {
    let dir = TempDir::new().unwrap();
    let ckpt = dir.path().join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    let worker = fsdp_tests::workspace_file("tests/py/elastic_worker.py");
    let agent = AgentCmd::new(dir.path(), "spare-killed")
        .args([
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "3",
            "--prewarm",
        ])
        .arg_path(&worker)
        .arg_path(&ckpt)
        .args(["1000000"])
        .env("PYTHON", python())
        .spawn();
    let mut workers = Vec::new();
    let mut spares = Vec::new();
    wait_for("the workers and the next start's spares", LIMIT, || {
        workers = worker_pids(&agent.stderr());
        spares = spares_of(agent.pid(), &workers);
        workers.len() == 2 && spares.len() == 2
    });
    // A spare killed before it is used, then a worker crash: that rank restarts cold and
    // says why; the other rank's spare is used.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(spares[0]),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    wait_for("the killed spare to be gone", LIMIT, || !alive(spares[0]));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(workers[1]),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    wait_for("the restart", LIMIT, || {
        agent
            .stdout()
            .lines()
            .filter(|l| l.contains("start ") && l.contains("restart=1"))
            .count()
            == 2
    });
    let err = agent.stderr();
    assert!(
        err.contains("starting the worker cold") && err.contains("the spare exited (signal 9"),
        "{err}"
    );
    assert_eq!(
        warm_starts(&err),
        1 + 2,
        "the first round warm, then one of the two\n{err}"
    );
    let metrics = fsdp_tests::metrics_text(&agent.status_addr());
    for line in [
        "fsdp_agent_worker_starts_total{start=\"warm\"} 3",
        "fsdp_agent_worker_starts_total{start=\"cold\"} 1",
    ] {
        assert!(metrics.contains(line), "{line}\n{metrics}");
    }

    // The agent dies without a word: every spare and worker goes with it.
    let mut everyone = Vec::new();
    wait_for("the next spares", LIMIT, || {
        let w = worker_pids(&agent.stderr());
        let s = spares_of(agent.pid(), &w);
        everyone = w.into_iter().chain(s.iter().copied()).collect();
        s.len() == 2
    });
    agent.signal(libc::SIGKILL);
    wait_for("no spare or worker left", LIMIT, || {
        everyone.iter().all(|p| !alive(*p))
    });
}

#[test]
fn three_pods_re_form_warm_after_a_sigterm_and_a_sigkill_and_restart_warm_after_a_crash() {
    let mut job = Job::new("prewarm-reform", "2:3", 3, 1_000_000, 47);
    job.agent_flags = vec!["--prewarm".into()];
    let mut pods: Vec<_> = (0..3).map(|i| job.pod(i, &[])).collect();
    wait_until("a group of 3", &[&pods[0], &pods[1], &pods[2]], || {
        (0..3).all(|i| nth_start_world(&pods[i], 0, 3))
    });
    job.progresses(3, &[&pods[0], &pods[1], &pods[2]]);
    // Pod delete: SIGTERM to its agent. The survivors' next workers come from spares.
    pods[2].signal(nix::sys::signal::Signal::SIGTERM);
    wait_until("the survivors at 2", &[&pods[0], &pods[1]], || {
        nth_start_world(&pods[0], 1, 2) && nth_start_world(&pods[1], 1, 2)
    });
    job.progresses(3, &[&pods[0], &pods[1]]);
    for p in &pods[..2] {
        assert_eq!(
            warm_starts(&p.stderr()),
            2,
            "first round and re-form warm\n{}",
            p.output()
        );
    }
    // A new pod joins, then one is SIGKILLed: the survivors re-form warm again.
    pods[2] = job.pod(2, &[]);
    wait_until("back to 3", &[&pods[0], &pods[1], &pods[2]], || {
        starts(&pods[0]).iter().filter(|s| s.world == 3).count() == 2
    });
    pods[1].kill();
    wait_until("the survivors at 2 again", &[&pods[0], &pods[2]], || {
        starts(&pods[0]).last().is_some_and(|s| s.world == 2)
            && starts(&pods[2]).last().is_some_and(|s| s.world == 2)
    });
    job.progresses(3, &[&pods[0], &pods[2]]);
    let p0 = pods[0].stderr();
    assert_eq!(
        warm_starts(&p0),
        starts(&pods[0]).len(),
        "every start of pod0 warm\n{p0}"
    );
    assert!(!p0.contains("starting the worker cold"), "{p0}");
}

#[test]
fn a_crash_restart_is_warm() {
    let job = {
        let mut j = Job::new("prewarm-crash", "2:2", 3, 1_000_000, 48);
        j.agent_flags = vec!["--prewarm".into()];
        j
    };
    let pods: Vec<_> = (0..2)
        .map(|i| job.pod(i, &["--fail-first-on-all"]))
        .collect();
    wait_until("the restart", &[&pods[0], &pods[1]], || {
        (0..2).all(|i| starts(&pods[i]).iter().any(|s| s.restart == 1))
    });
    job.progresses(3, &[&pods[0], &pods[1]]);
    for p in &pods {
        let err = p.stderr();
        assert_eq!(warm_starts(&err), 2, "{}", p.output());
    }
}

#[test]
fn a_spare_starts_with_its_ranks_device_and_without_any_rounds_variables() {
    let dir = TempDir::new().unwrap();
    let ckpt = dir.path().join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    let worker = fsdp_tests::workspace_file("tests/py/elastic_worker.py");
    let agent = AgentCmd::new(dir.path(), "spare-env")
        .args(["--standalone", "--nproc-per-node", "2", "--prewarm"])
        .args(["--virtual-local-rank"])
        .arg_path(&worker)
        .arg_path(&ckpt)
        .args(["1000000"])
        .env("PYTHON", python())
        .env("CUDA_VISIBLE_DEVICES", "4,5")
        .spawn();
    let mut spares = Vec::new();
    wait_for("the next start's spares", LIMIT, || {
        spares = spares_of(agent.pid(), &worker_pids(&agent.stderr()));
        spares.len() == 2
    });
    let mut devices = Vec::new();
    for pid in spares {
        let raw = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
        let env: BTreeMap<String, String> = raw
            .split(|b| *b == 0)
            .filter_map(|kv| {
                String::from_utf8_lossy(kv)
                    .split_once('=')
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
            })
            .collect();
        for k in [
            "RANK",
            "WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "TORCHELASTIC_RESTART_COUNT",
            "GROUP_RANK",
        ] {
            assert!(
                !env.contains_key(k),
                "a spare must not see {k} before its round: {env:?}"
            );
        }
        // --virtual-local-rank: the spare already has its one device, as its worker will.
        assert_eq!(
            env.get("LOCAL_RANK").map(String::as_str),
            Some("0"),
            "{env:?}"
        );
        devices.push(env["CUDA_VISIBLE_DEVICES"].clone());
    }
    devices.sort();
    assert_eq!(devices, ["4", "5"]);
}

#[test]
fn a_module_the_spare_cannot_import_turns_pre_warming_off_with_one_warning() {
    let dir = TempDir::new().unwrap();
    std::fs::write(
        dir.path().join("hello.py"),
        "print('hello from', __name__)\n",
    )
    .unwrap();
    let mut agent = AgentCmd::new(dir.path(), "bad-module")
        .args(["--standalone", "--nproc-per-node", "2", "--prewarm"])
        .args(["--prewarm-modules", "torch,no_such_module_here"])
        .arg_path(dir.path().join("hello.py"))
        .env("PYTHON", python())
        .run(LIMIT);
    assert_eq!(agent.code(), 0, "{}", agent.output());
    let (out, err) = (agent.stdout(), agent.stderr());
    assert_eq!(out.matches("hello from __main__").count(), 2, "{out}");
    assert!(
        err.contains("import no_such_module_here failed: ModuleNotFoundError"),
        "{err}"
    );
    assert_eq!(
        err.matches("no more spares; workers start cold").count(),
        1,
        "{err}"
    );
    assert_eq!(warm_starts(&err), 0, "{err}");
}

#[test]
fn prewarm_needs_python() {
    let dir = TempDir::new().unwrap();
    let mut agent = AgentCmd::new(dir.path(), "no-python")
        .args(["--standalone", "--prewarm", "--no-python", "true"])
        .run(LIMIT);
    assert_eq!(agent.code(), 64, "{}", agent.output());
    assert!(
        agent
            .stderr()
            .contains("--prewarm keeps Python interpreters ready"),
        "{}",
        agent.stderr()
    );
}
