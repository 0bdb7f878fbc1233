//! torchrun and fsdp-agent side by side: the same scripts under both, compared
//! field by field. They must agree everywhere except the deliberate differences tabled in
//! docs/migrating-from-torchrun.md#behaviour-differences, which are asserted here as such.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use fsdp_tests::{TempDir, agent_bin, python};

/// The launcher under test.
#[derive(Clone, Copy, Debug)]
enum Launcher {
    Torchrun,
    Agent,
}

impl Launcher {
    fn program(self) -> PathBuf {
        match self {
            Self::Torchrun => python().with_file_name("torchrun"),
            Self::Agent => agent_bin(),
        }
    }

    /// Runs `args` in `dir` with a clean environment (plus `env`).
    fn run(self, dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
        let mut cmd = clean(Command::new(self.program()), dir);
        cmd.args(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.output().expect("run the launcher")
    }
}

/// `cmd` in `dir` with nothing of the test's environment: the venv's bin first on PATH, so
/// both launchers find the same python, and no status port.
fn clean(mut cmd: Command, dir: &Path) -> Command {
    let bin = python().parent().unwrap().to_owned();
    cmd.env_clear()
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .env(
            "HOME",
            std::env::var("HOME").unwrap_or_else(|_| "/root".into()),
        )
        .env("FSDP_STATUS_ADDR", "off")
        // The run's temporary directory (scripts/test.sh's): log directories go there.
        .env("TMPDIR", std::env::temp_dir())
        .current_dir(dir)
        .stdin(std::process::Stdio::null());
    cmd
}

const DUMP: &str = r#"import json, os, sys
out = sys.argv[1]
with open(os.path.join(out, "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump({"env": dict(os.environ), "argv": sys.argv[2:], "path0": sys.path[0],
               "cwd": os.getcwd()}, f)
"#;

fn dump(dir: &Path, rank: u32) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join(format!("rank{rank}.json"))).expect("a dump");
    serde_json::from_str(&text).unwrap()
}

/// Every variable of every rank's environment is the same under both launchers, but those
/// in `skipped`.
fn assert_same_env(dumps: &BTreeMap<&str, [serde_json::Value; 2]>, skipped: &[&str]) {
    for (rank, (t, a)) in dumps["torchrun"].iter().zip(&dumps["agent"]).enumerate() {
        let (te, ae) = (t["env"].as_object().unwrap(), a["env"].as_object().unwrap());
        let keys: std::collections::BTreeSet<&String> = te.keys().chain(ae.keys()).collect();
        for k in keys.into_iter().filter(|k| !skipped.contains(&k.as_str())) {
            assert_eq!(te.get(k), ae.get(k), "rank {rank}: {k}");
        }
    }
}

#[test]
fn the_workers_see_the_same_environment_argv_path_and_directory() {
    let dir = TempDir::new().unwrap();
    std::fs::write(dir.path().join("dump.py"), DUMP).unwrap();
    let mut dumps = BTreeMap::new();
    for (name, launcher) in [("torchrun", Launcher::Torchrun), ("agent", Launcher::Agent)] {
        let out_dir = dir.path().join(name);
        std::fs::create_dir_all(&out_dir).unwrap();
        let out = launcher.run(
            dir.path(),
            &[
                "--standalone",
                "--nproc-per-node",
                "2",
                "dump.py",
                out_dir.to_str().unwrap(),
                "x",
                "--lr",
                "3e-4",
            ],
            &[],
        );
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        dumps.insert(name, [dump(&out_dir, 0), dump(&out_dir, 1)]);
    }
    // Documented: ours only, or another value by design.
    let differ_by_design = [
        "FSDP_AGENT_PROGRESS",
        "FSDP_AGENT_CONTROL",
        "FSDP_STATUS_ADDR",
        "TORCHELASTIC_USE_AGENT_STORE",
    ];
    // Fresh per run under both: compared by form, not value.
    let fresh = [
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_ERROR_FILE",
    ];
    let skipped: Vec<&str> = differ_by_design.iter().chain(&fresh).copied().collect();
    assert_same_env(&dumps, &skipped);
    for (rank, (t, a)) in dumps["torchrun"].iter().zip(&dumps["agent"]).enumerate() {
        for field in ["argv", "path0", "cwd"] {
            assert_eq!(t[field], a[field], "rank {rank}: {field}");
        }
        let (te, ae) = (t["env"].as_object().unwrap(), a["env"].as_object().unwrap());
        assert_eq!(te["TORCHELASTIC_USE_AGENT_STORE"], "True");
        assert_eq!(ae["TORCHELASTIC_USE_AGENT_STORE"], "False");
        for env in [te, ae] {
            assert!(env["MASTER_PORT"].as_str().unwrap().parse::<u16>().is_ok());
            assert!(!env["TORCHELASTIC_RUN_ID"].as_str().unwrap().is_empty());
            let error_file = env["TORCHELASTIC_ERROR_FILE"].as_str().unwrap();
            assert!(
                error_file.ends_with(&format!("/attempt_0/{rank}/error.json")),
                "{error_file}"
            );
        }
    }
}

#[test]
fn two_c10d_nodes_give_their_workers_the_same_environment() {
    // torchrun's multi-node recipe without etcd, under both: two launchers on one
    // endpoint, the first to bind serves the store. MASTER_PORT differs by design: torchrun
    // hands the workers its rendezvous store's port, we a fresh one for worker rank 0.
    let dir = TempDir::new().unwrap();
    std::fs::write(dir.path().join("dump.py"), DUMP).unwrap();
    let mut dumps = BTreeMap::new();
    for (name, launcher) in [("torchrun", Launcher::Torchrun), ("agent", Launcher::Agent)] {
        let out_dir = dir.path().join(name);
        std::fs::create_dir_all(&out_dir).unwrap();
        let endpoint = format!("127.0.0.1:{}", fsdp_tests::free_port());
        let args = [
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            &endpoint,
            "--rdzv-id",
            "compat",
            "--local-addr",
            "127.0.0.1",
            "dump.py",
            out_dir.to_str().unwrap(),
        ];
        let nodes: Vec<std::process::Child> = (0..2)
            .map(|_| {
                let mut cmd = clean(Command::new(launcher.program()), dir.path());
                cmd.args(args)
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::piped());
                cmd.spawn().expect("start the launcher")
            })
            .collect();
        for node in nodes {
            let out = node.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "{name}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        dumps.insert(name, [dump(&out_dir, 0), dump(&out_dir, 1)]);
    }
    let differ_by_design = [
        "FSDP_AGENT_PROGRESS",
        "FSDP_AGENT_CONTROL",
        "FSDP_STATUS_ADDR",
        "TORCHELASTIC_USE_AGENT_STORE",
        "MASTER_PORT",
        "TORCHELASTIC_ERROR_FILE",
    ];
    assert_same_env(&dumps, &differ_by_design);
    for a in &dumps["agent"] {
        let ae = a["env"].as_object().unwrap();
        assert_eq!(ae["WORLD_SIZE"], "2");
        assert_eq!(ae["TORCHELASTIC_RUN_ID"], "compat");
        assert_eq!(ae["TORCHELASTIC_USE_AGENT_STORE"], "False");
    }
}

#[test]
fn exit_codes_agree_except_where_fsdp_agent_passes_the_workers_on() {
    let dir = TempDir::new().unwrap();
    let code = |launcher: Launcher, body: &str| {
        let script = dir.path().join("exit.py");
        std::fs::write(&script, body).unwrap();
        launcher
            .run(dir.path(), &["--standalone", "exit.py"], &[])
            .status
            .code()
    };
    for (body, torchrun, agent) in [
        ("pass\n", 0, 0),
        ("import sys; sys.exit(3)\n", 1, 3),
        (
            "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)\n",
            1,
            139,
        ),
    ] {
        assert_eq!(
            code(Launcher::Torchrun, body),
            Some(torchrun),
            "torchrun: {body}"
        );
        assert_eq!(
            code(Launcher::Agent, body),
            Some(agent),
            "fsdp-agent: {body}"
        );
    }
}

#[test]
fn the_launchers_error_file_says_the_same_root_cause() {
    let dir = TempDir::new().unwrap();
    std::fs::write(
        dir.path().join("fail.py"),
        "from torch.distributed.elastic.multiprocessing.errors import record\n\
         @record\n\
         def main():\n    raise KeyError('no such column: label')\n\
         main()\n",
    )
    .unwrap();
    let mut files = Vec::new();
    for (name, launcher) in [("torchrun", Launcher::Torchrun), ("agent", Launcher::Agent)] {
        let file = dir.path().join(format!("{name}-error.json"));
        let out = launcher.run(
            dir.path(),
            &["--standalone", "fail.py"],
            &[("TORCHELASTIC_ERROR_FILE", file.to_str().unwrap())],
        );
        assert_eq!(out.status.code(), Some(1), "{name}");
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&file).expect(name)).unwrap();
        files.push(json);
    }
    let (t, a) = (&files[0], &files[1]);
    assert_eq!(t["message"]["message"], a["message"]["message"]);
    assert!(
        a["message"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("KeyError")),
        "{a}"
    );
    assert_eq!(t["message"]["errorCode"], a["message"]["errorCode"]);
    assert_eq!(a["message"]["errorCode"], 1, "{a}");
    assert!(
        a["message"]["extraInfo"]["py_callstack"]
            .as_str()
            .is_some_and(|s| s.contains("raise KeyError")),
        "{a}"
    );
}

#[test]
fn the_bytes_workers_write_to_a_terminal_are_the_same() {
    let dir = TempDir::new().unwrap();
    std::fs::write(
        dir.path().join("tty.py"),
        "import os, sys\n\
         if os.environ['RANK'] == '0':\n    print('isatty', sys.stdout.isatty())\n    print('\\x1b[32mgreen\\x1b[0m 50%\\r100%')\n",
    )
    .unwrap();
    let bytes = |launcher: Launcher| {
        // The launcher's own messages go to stderr, away from the comparison.
        let inner = format!(
            "{} --standalone --nproc-per-node 2 tty.py 2>/dev/null",
            launcher.program().display()
        );
        let out = clean(Command::new("script"), dir.path())
            .args(["-qec", &inner, "/dev/null"])
            .output()
            .expect("script (util-linux)");
        assert!(out.status.success(), "{launcher:?}");
        out.stdout
    };
    let (t, a) = (bytes(Launcher::Torchrun), bytes(Launcher::Agent));
    assert_eq!(
        String::from_utf8_lossy(&t),
        String::from_utf8_lossy(&a),
        "the workers' bytes differ"
    );
    assert!(String::from_utf8_lossy(&a).contains("isatty True"));
}

/// One node under each launcher: the job can never form, so fsdp-agent says so
/// in one line and exits 64 instead of waiting with the other side. `torchrun_first` says
/// which launcher has node 0 (static) or serves the store (c10d, where the first to start
/// binds the endpoint).
fn a_mixed_job_fails_with_one_line(backend: &str, torchrun_first: bool) {
    let dir = TempDir::new().unwrap();
    std::fs::write(
        dir.path().join("train.py"),
        "import torch.distributed as dist\ndist.init_process_group('gloo')\nprint('formed', flush=True)\n",
    )
    .unwrap();
    let port = fsdp_tests::free_port().to_string();
    let endpoint = format!("127.0.0.1:{port}");
    let node = |launcher: Launcher, rank: &str| {
        let mut cmd = clean(Command::new(launcher.program()), dir.path());
        cmd.args(["--nnodes", "2", "--nproc-per-node", "1"]);
        if backend == "static" {
            cmd.args(["--node-rank", rank, "--master-addr", "127.0.0.1"])
                .args(["--master-port", &port]);
        } else {
            cmd.args(["--rdzv-backend", "c10d", "--rdzv-endpoint", &endpoint])
                .args(["--rdzv-id", "mixed", "--local-addr", "127.0.0.1"]);
        }
        cmd.arg("train.py")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        cmd.spawn().expect("start the launcher")
    };
    let (first, second) = if torchrun_first {
        (Launcher::Torchrun, Launcher::Agent)
    } else {
        (Launcher::Agent, Launcher::Torchrun)
    };
    let first = node(first, "0");
    // The first serves the store (c10d) or hosts node 0's (static) before the other comes.
    std::thread::sleep(std::time::Duration::from_secs(3));
    let second = node(second, "1");
    let started = std::time::Instant::now();
    let (mut agent, mut torchrun) = if torchrun_first {
        (second, first)
    } else {
        (first, second)
    };
    let mut code = None;
    while started.elapsed() < std::time::Duration::from_secs(60) {
        if let Some(s) = agent.try_wait().unwrap() {
            code = s.code();
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let took = started.elapsed();
    let _ = torchrun.kill();
    let _ = agent.kill();
    let out = agent.wait_with_output().unwrap();
    let _ = torchrun.wait();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        code,
        Some(64),
        "{backend}, torchrun first: {torchrun_first}\n{err}"
    );
    assert!(
        err.contains("the other node runs torchrun; run the same launcher on every node"),
        "{err}"
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("formed"));
    println!(
        "{backend}, torchrun first {torchrun_first}: fsdp-agent ended {took:?} after the second node started"
    );
}

#[test]
fn a_static_job_with_torchrun_on_node_0_fails_with_one_line() {
    a_mixed_job_fails_with_one_line("static", true);
}

#[test]
fn a_static_job_with_torchrun_on_node_1_fails_with_one_line() {
    a_mixed_job_fails_with_one_line("static", false);
}

#[test]
fn a_c10d_job_whose_store_torchrun_serves_fails_with_one_line() {
    a_mixed_job_fails_with_one_line("c10d", true);
}

#[test]
fn a_c10d_job_whose_store_fsdp_agent_serves_fails_with_one_line() {
    a_mixed_job_fails_with_one_line("c10d", false);
}
