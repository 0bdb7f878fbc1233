//! Real PyTorch workers: an unmodified `init_process_group("gloo")` + `all_reduce` script
//! under the agent, on one node and as a static group of two agents.

use std::time::Duration;

use fsdp_tests::{AgentCmd, TempDir, free_port, python, workspace_file};

const LIMIT: Duration = Duration::from_secs(180);

fn sums(out: &str) -> Vec<String> {
    out.lines()
        .filter(|l| l.contains("all_reduce sum"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn allreduce_with_two_workers_standalone() {
    let dir = TempDir::new().unwrap();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .env("PYTHON", python())
        .args(fsdp_tests::WHOLE_LINES)
        .args(["--standalone", "--nproc-per-node", "2"])
        .arg_path(workspace_file("examples/allreduce.py"))
        .run(LIMIT);
    assert_eq!(a.code(), 0, "{}", a.output());
    let out = a.stdout();
    let lines = sums(&out);
    assert_eq!(lines.len(), 2, "{out}");
    for rank in 0..2 {
        let line = lines
            .iter()
            .find(|l| l.starts_with(&format!("[default{rank}]:rank {rank}/2")))
            .unwrap_or_else(|| panic!("no line from rank {rank}:\n{out}"));
        assert!(line.contains("all_reduce sum = 3 (expected 3)"), "{line}");
    }
    assert!(
        a.stderr().contains("master_addr=localhost master_port="),
        "{}",
        a.stderr()
    );
}

#[test]
fn allreduce_across_two_static_agents() {
    let dir = TempDir::new().unwrap();
    let port = free_port().to_string();
    let agent = |rank: &str| {
        AgentCmd::new(dir.path(), &format!("node{rank}"))
            .env("PYTHON", python())
            .args([
                "--nnodes",
                "2",
                "--node-rank",
                rank,
                "--nproc-per-node",
                "2",
            ])
            .args(["--master-addr", "127.0.0.1", "--master-port", &port])
            .arg_path(workspace_file("examples/allreduce.py"))
            .spawn()
    };
    let (mut n0, mut n1) = (agent("0"), agent("1"));
    for (node, a) in [(0, &mut n0), (1, &mut n1)] {
        assert_eq!(a.code(), 0, "node {node}: {}", a.output());
        let out = a.stdout();
        let lines = sums(&out);
        assert_eq!(lines.len(), 2, "{out}");
        // World of 4: 1+2+3+4 = 10; node 1 holds global ranks 2 and 3.
        for line in &lines {
            assert!(line.contains("all_reduce sum = 10 (expected 10)"), "{line}");
            assert!(
                line.contains(&format!("rank {}", 2 * node))
                    || line.contains(&format!("rank {}", 2 * node + 1)),
                "{line}"
            );
        }
        assert!(
            a.stderr()
                .contains(&format!("master_addr=127.0.0.1 master_port={port}")),
            "{}",
            a.stderr()
        );
    }
}

#[test]
fn a_python_exception_is_summarised_from_the_error_file() {
    let dir = TempDir::new().unwrap();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .env("PYTHON", python())
        .args(["--standalone", "--nproc-per-node", "2"])
        .arg_path(workspace_file("tests/py/raise_with_record.py"))
        .run(LIMIT);
    // Python exits 1 on an uncaught exception; the agent propagates it.
    assert_eq!(a.code(), 1, "{}", a.output());
    let err = a.stderr();
    assert!(
        err.contains("Root cause (first observed failure):\n  rank 1 (local_rank 1"),
        "{err}"
    );
    assert!(
        err.contains("message: ValueError: deliberate failure on local rank 1"),
        "{err}"
    );
    assert!(err.contains("Traceback"), "{err}");
}

#[test]
fn module_and_run_path_run_under_python_like_torchrun() {
    let dir = TempDir::new().unwrap();
    std::fs::write(
        dir.path().join("hello_mod.py"),
        "import os, sys\nprint('module', __name__, os.environ['RANK'], sys.argv[1:], flush=True)\nprint('path0', sys.path[0], flush=True)\n",
    )
    .unwrap();
    let mut a = AgentCmd::new(dir.path(), "module")
        .env("PYTHON", python())
        .env("PYTHONPATH", dir.path())
        .args(fsdp_tests::WHOLE_LINES)
        .args([
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "hello_mod",
            "--lr",
            "1",
        ])
        .run(LIMIT);
    assert_eq!(a.code(), 0, "{}", a.output());
    assert!(
        a.stdout()
            .lines()
            .any(|l| l == "[default1]:module __main__ 1 ['--lr', '1']"),
        "{}",
        a.stdout()
    );

    let script = dir.path().join("hello_mod.py");
    let mut a = AgentCmd::new(dir.path(), "run_path")
        .env("PYTHON", python())
        .args(["--standalone", "--run-path"])
        .arg_path(&script)
        .args(["x"])
        .run(LIMIT);
    assert_eq!(a.code(), 0, "{}", a.output());
    assert!(
        a.stdout().contains("module __main__ 0 ['x']"),
        "{}",
        a.stdout()
    );
    // torchrun's --run-path workers see torchrun's directory as sys.path[0]: the bin
    // directory of its environment, the interpreter's (not where this binary lives).
    let launcher_dir = python().parent().unwrap().display().to_string();
    assert_ne!(
        Some(python().parent().unwrap()),
        fsdp_tests::agent_bin().parent()
    );
    assert!(
        a.stdout()
            .lines()
            .any(|l| l == format!("path0 {launcher_dir}")),
        "{}",
        a.stdout()
    );
}

/// With `TORCHELASTIC_ERROR_FILE` in the agent's own environment (a scheduler's), the root
/// cause of a failed job is written there in torchrun's format: the worker's own `@record`
/// file with `errorCode` set, or, when it wrote none, one saying how it ended.
#[test]
fn the_launchers_error_file_gets_the_root_cause() {
    let dir = TempDir::new().unwrap();
    let launcher = dir.path().join("scheduler/error.json");
    let mut a = AgentCmd::new(dir.path(), "agent")
        .env("PYTHON", python())
        .env("TORCHELASTIC_ERROR_FILE", &launcher)
        .args(["--standalone", "--nproc-per-node", "2"])
        .arg_path(workspace_file("tests/py/raise_with_record.py"))
        .run(LIMIT);
    assert_eq!(a.code(), 1, "{}", a.output());
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&launcher).expect("the launcher's file"))
            .unwrap();
    assert_eq!(json["message"]["errorCode"], 1, "{json}");
    let message = json["message"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("ValueError"), "{json}");
    assert!(
        json["message"]["extraInfo"]["py_callstack"]
            .as_str()
            .is_some_and(|t| t.contains("Traceback")),
        "{json}"
    );

    std::fs::remove_file(&launcher).unwrap();
    let mut a = AgentCmd::new(dir.path(), "plain")
        .env("TORCHELASTIC_ERROR_FILE", &launcher)
        .args(["--standalone", "--no-python", "sh", "-c", "exit 3"])
        .run(LIMIT);
    assert_eq!(a.code(), 3, "{}", a.output());
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&launcher).unwrap()).unwrap();
    assert_eq!(json["message"]["errorCode"], 3, "{json}");
    assert!(
        json["message"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("worker rank 0") && m.contains("exit code 3")),
        "{json}"
    );
}

/// With stderr in a log file the summary quotes its last lines; an import error (before
/// any main could run) gets no `@record` advice, which could not have helped.
#[test]
fn the_summary_quotes_the_workers_last_stderr_lines_and_advises_only_what_helps() {
    let dir = TempDir::new().unwrap();
    let script = dir.path().join("broken.py");
    std::fs::write(&script, "import no_such_module_here\n").unwrap();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .env("PYTHON", python())
        .args(["--standalone", "--nproc-per-node", "1", "-r", "2"])
        .args(["--log-dir", dir.path().join("logs").to_str().unwrap()])
        .arg_path(&script)
        .run(LIMIT);
    assert_eq!(a.code(), 1, "{}", a.output());
    let err = a.stderr();
    assert!(err.contains("last lines of its stderr:"), "{err}");
    assert!(
        err.contains("    ModuleNotFoundError: No module named 'no_such_module_here'"),
        "{err}"
    );
    assert!(!err.contains("decorate the worker's main"), "{err}");
}
