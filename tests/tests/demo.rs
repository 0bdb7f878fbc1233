//! The elastic demo, in a reduced form: `scripts/demo/elastic.py` with fewer
//! steps, its narration checked line by line, and nothing left behind.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fsdp_tests::{TempDir, agent_bin, workspace_file};

/// Processes whose command line mentions `dir` (the demo puts its work directory in every
/// agent's, worker's and etcd's arguments).
fn left_behind(dir: &Path) -> Vec<String> {
    let needle = dir.display().to_string();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        let state = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        if cmdline.contains(&needle) && !state.contains(") Z ") {
            found.push(cmdline);
        }
    }
    found
}

fn demo(dir: &Path, steps: u32) -> Command {
    let mut cmd = Command::new("python3");
    cmd.arg(workspace_file("scripts/demo/elastic.py"))
        .arg("--agent")
        .arg(agent_bin())
        .arg("--trainer")
        .arg(agent_bin().with_file_name("fsdp-trainer"))
        .args(["--steps", &steps.to_string(), "--workdir"])
        .arg(dir)
        .stdin(Stdio::null());
    cmd
}

/// One narrated number after `key` in `line` (e.g. "at step 96").
fn number_after(line: &str, key: &str) -> u32 {
    line.split(key)
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no number after '{key}' in: {line}"))
}

#[test]
fn the_elastic_demo_narrates_the_kill_the_re_form_and_the_regrow_and_cleans_up() {
    let dir = TempDir::new().unwrap();
    let out = demo(dir.path(), 320).output().expect("run the demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let line = |start: &str| -> String {
        stdout
            .lines()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("no line starting '{start}'\n{stdout}"))
            .to_owned()
    };
    // Every event: the survivors re-form in place (the same worker processes) and the
    // group goes on from the step it was at, rebuilt from peer memory: nothing redone.
    let in_place = |l: &str, kept: &str| {
        assert!(l.contains("resumed from peer memory at step"), "{l}");
        assert!(
            number_after(l, "peer memory at step ") >= number_after(l, "at step "),
            "{l}"
        );
        assert!(l.contains("(0 steps redone)"), "{l}");
        assert!(
            l.contains(&format!("nodes {kept} kept their worker processes")),
            "{l}"
        );
    };
    let kill = line("[demo] killed node 2 (SIGKILL) at step");
    assert!(kill.contains("→ nodes 0, 1 re-formed in"), "{kill}");
    assert!(kill.contains("(world 3 → 2)"), "{kill}");
    in_place(&kill, "0, 1");
    let back = line("[demo] node 2 back");
    assert!(back.contains("(world 2 → 3)"), "{back}");
    in_place(&back, "0, 1");
    let deleted = line("[demo] deleted node 1 (SIGTERM");
    assert!(deleted.contains("(world 3 → 2)"), "{deleted}");
    // The deleted node's agent warned its worker, which left at the next step boundary
    // with its part copied to its buddy.
    in_place(&deleted, "0, 2");
    assert!(stdout.contains("node 1's agent exited 143"), "{stdout}");
    assert!(line("[demo] node 1 back").contains("(world 2 → 3)"));
    assert!(stdout.contains("Training finished at step 320"), "{stdout}");
    assert!(stdout.contains("fsdp-agent status, taken now:"), "{stdout}");
    assert!(stdout.contains("loss by step"), "{stdout}");
    assert!(stdout.contains("every agent exited 0"), "{stdout}");
    // No worker's stop was taken for a failure: a rank warned only through the others
    // waits for its own agent's word, so no restart was ever charged.
    for e in std::fs::read_dir(dir.path()).unwrap().flatten() {
        if e.file_name().to_string_lossy().ends_with(".err") {
            let log = std::fs::read_to_string(e.path()).unwrap();
            for formed in log.lines().filter(|l| l.contains("group formed")) {
                assert!(formed.contains("restart_count=0"), "{formed}\n{log}");
            }
        }
    }
    let left = left_behind(dir.path());
    assert!(left.is_empty(), "left running: {left:?}");
    assert!(!dir.path().join("etcd").exists(), "etcd's data is removed");
}

#[test]
fn ctrl_c_stops_every_agent_worker_and_etcd() {
    let dir = TempDir::new().unwrap();
    let log = dir.path().join("demo.log");
    let mut child = demo(dir.path(), 100_000)
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let end = Instant::now() + Duration::from_secs(120);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("group of 3 formed")
    {
        assert!(Instant::now() < end, "no group formed");
        assert!(child.try_wait().unwrap().is_none(), "the demo ended early");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        !left_behind(dir.path()).is_empty(),
        "the demo runs something"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130));
    let left = left_behind(dir.path());
    assert!(left.is_empty(), "left running: {left:?}");
}
