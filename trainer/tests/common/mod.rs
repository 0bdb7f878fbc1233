//! What the trainer's end-to-end tests share: the binaries, a clean environment, runs
//! alone or under fsdp-agent, and the log lines they read.

#![allow(dead_code)] // each test file uses its own part

use std::path::PathBuf;
use std::process::{Command, Output};

pub fn trainer() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_fsdp-trainer"))
}

pub fn agent() -> PathBuf {
    let p = trainer().with_file_name("fsdp-agent");
    assert!(
        p.exists(),
        "{} is missing: build the workspace first (cargo build --workspace)",
        p.display()
    );
    p
}

/// Small and quick: trains in about a second per 50 steps on one CPU.
pub const MODEL: [&str; 4] = ["--logging_freq", "1", "--threads", "1"];

pub fn clean(cmd: &mut Command) -> &mut Command {
    for k in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "FSDP_TRAINER_CRASH_IN_SAVE",
    ] {
        cmd.env_remove(k);
    }
    cmd.env("FSDP_STATUS_ADDR", "off")
}

pub fn alone(args: &[&str]) -> Command {
    let mut c = Command::new(trainer());
    clean(&mut c).args(MODEL).args(args);
    c
}

pub fn launched(nproc: u32, args: &[&str]) -> Command {
    let mut c = Command::new(agent());
    clean(&mut c)
        .args([
            "--standalone",
            "--nproc-per-node",
            &nproc.to_string(),
            "--no-python",
        ])
        .arg(trainer())
        .args(MODEL)
        .args(args);
    c
}

pub fn run(mut c: Command) -> Output {
    let out = c.output().expect("run");
    assert!(
        out.status.success(),
        "{c:?} failed: {:?}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `(step, loss)` from every `Batch N Loss: X, ...` line (with or without the agent's
/// `[default0]:` prefix).
pub fn losses(text: &str) -> Vec<(u64, f64)> {
    text.lines()
        .filter_map(|l| {
            let rest = &l[l.find("Batch ")? + 6..];
            let (step, rest) = rest.split_once(" Loss: ")?;
            let loss = rest.split(',').next()?;
            Some((step.parse().ok()?, loss.parse().ok()?))
        })
        .collect()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn assert_close(a: &[(u64, f64)], b: &[(u64, f64)], tol: f64) {
    assert_eq!(
        a.iter().map(|x| x.0).collect::<Vec<_>>(),
        b.iter().map(|x| x.0).collect::<Vec<_>>(),
        "the same steps were logged"
    );
    for ((s, x), (_, y)) in a.iter().zip(b) {
        assert!(
            (x - y).abs() <= tol,
            "step {s}: loss {x} vs {y} (tolerance {tol})"
        );
    }
}

pub fn fails_with(mut cmd: Command, code: i32, needle: &str) {
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{err}");
    assert!(err.contains(needle), "expected '{needle}' in: {err}");
}

pub fn python() -> PathBuf {
    std::env::var_os("FSDP_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME"))
                .join(".cache/fsdp-agent/venv/bin/python")
        })
}
