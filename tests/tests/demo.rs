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
    let kill = line("[demo] killed node 2 (SIGKILL) at step");
    assert!(kill.contains("→ nodes 0, 1 re-formed in"), "{kill}");
    assert!(kill.contains("(world 3 → 2)"), "{kill}");
    let (at, resumed) = (
        number_after(&kill, "at step "),
        number_after(&kill, "checkpoint of step "),
    );
    // Resumed from the newest checkpoint saved before the kill, not an older one.
    let saved: Vec<u32> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".out"))
        .flat_map(|e| {
            std::fs::read_to_string(e.path())
                .unwrap()
                .lines()
                .filter_map(|l| l.split("Saved checkpoint ").nth(1).map(str::to_owned))
                .map(|rest| number_after(&rest, "(step "))
                .collect::<Vec<_>>()
        })
        .collect();
    let newest_before = saved
        .iter()
        .filter(|&&s| s <= at)
        .max()
        .copied()
        .unwrap_or(0);
    assert!(
        resumed >= newest_before && newest_before > 0,
        "resumed from {resumed}, newest checkpoint before step {at} was {newest_before}"
    );
    let back = line("[demo] node 2 back");
    assert!(back.contains("(world 2 → 3)"), "{back}");
    // A join loses nobody: the survivors were warned, saved at the next step and stopped,
    // and the group of 3 resumed there.
    assert!(back.contains("(0 steps redone)"), "{back}");
    assert!(
        number_after(&back, "checkpoint of step ") >= number_after(&back, "at step "),
        "{back}"
    );
    let deleted = line("[demo] deleted node 1 (SIGTERM");
    assert!(deleted.contains("(world 3 → 2)"), "{deleted}");
    // The deleted node's agent warned its worker instead: the whole group saved at the
    // next step before the node went, and the two left resumed there.
    assert!(deleted.contains("(0 steps redone)"), "{deleted}");
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
