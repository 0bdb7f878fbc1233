//! Launch benchmark: fsdp-agent against torchrun on the same command, same machine, same
//! run. Measures wall time from exec to exit and the peak RSS of the launcher's process
//! tree (`ru_maxrss` from `wait4`: the largest process, which is the launcher itself since
//! the workers are `/bin/true`).
//!
//! Usage: bench-launch [--runs N] [--nproc N] [--agent PATH] [--torchrun PATH]

use std::process::Command;
use std::time::{Duration, Instant};

struct Sample {
    wall: Duration,
    max_rss_kib: i64,
}

fn run_once(cmd: &[String]) -> Sample {
    let start = Instant::now();
    #[expect(
        clippy::zombie_processes,
        reason = "reaped by wait4 below, which also gives its rusage"
    )]
    let child = Command::new(&cmd[0])
        .args(&cmd[1..])
        .env("LOGLEVEL", "WARNING")
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", cmd[0]));
    let mut status = 0;
    // SAFETY: rusage is plain data, fully written by wait4 on success.
    #[expect(
        unsafe_code,
        reason = "wait4 is the only way to get a child's rusage with its exit"
    )]
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        let pid = libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut usage);
        assert_eq!(pid, child.id() as libc::pid_t, "wait4 failed");
        usage
    };
    let wall = start.elapsed();
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{cmd:?} failed: status {status}"
    );
    Sample {
        wall,
        max_rss_kib: usage.ru_maxrss,
    }
}

fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() {
    let mut args = std::env::args().skip(1);
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let venv =
        std::env::var("FSDP_VENV").unwrap_or_else(|_| format!("{home}/.cache/fsdp-agent/venv"));
    let (mut runs, mut nproc) = (10usize, 2u32);
    let mut agent = "target/release/fsdp-agent".to_owned();
    let mut torchrun = format!("{venv}/bin/torchrun");
    while let Some(a) = args.next() {
        let mut v = || args.next().expect("flag needs a value");
        match a.as_str() {
            "--runs" => runs = v().parse().expect("runs"),
            "--nproc" => nproc = v().parse().expect("nproc"),
            "--agent" => agent = v(),
            "--torchrun" => torchrun = v(),
            other => panic!("unknown flag {other}"),
        }
    }
    let tail = [
        "--standalone".to_owned(),
        "--nproc-per-node".into(),
        nproc.to_string(),
        "--no-python".into(),
        "/bin/true".into(),
    ];
    let launchers = [("fsdp-agent", agent), ("torchrun", torchrun)];
    println!(
        "launch: --standalone --nproc-per-node {nproc} --no-python /bin/true, {runs} runs each (interleaved)"
    );
    let mut results: Vec<(&str, Vec<Sample>)> =
        launchers.iter().map(|(n, _)| (*n, Vec::new())).collect();
    // One warm-up each (page cache), then interleave so drift hits both alike.
    for (_, bin) in &launchers {
        run_once(
            &std::iter::once(bin.clone())
                .chain(tail.iter().cloned())
                .collect::<Vec<_>>(),
        );
    }
    for _ in 0..runs {
        for (i, (_, bin)) in launchers.iter().enumerate() {
            let cmd: Vec<String> = std::iter::once(bin.clone())
                .chain(tail.iter().cloned())
                .collect();
            results[i].1.push(run_once(&cmd));
        }
    }
    let mut medians = Vec::new();
    println!(
        "{:<12} {:>22} {:>26}",
        "launcher", "wall ms median [min-max]", "peak RSS MiB median [min-max]"
    );
    for (name, samples) in &results {
        let (w, wmin, wmax) = median(samples.iter().map(|s| s.wall.as_secs_f64() * 1e3).collect());
        let (r, rmin, rmax) = median(
            samples
                .iter()
                .map(|s| s.max_rss_kib as f64 / 1024.0)
                .collect(),
        );
        println!("{name:<12} {w:>8.1} [{wmin:.1}-{wmax:.1}] {r:>14.1} [{rmin:.1}-{rmax:.1}]");
        medians.push((w, r));
    }
    let (ours, theirs) = (medians[0], medians[1]);
    println!(
        "ratio: fsdp-agent is {:.0}x faster to launch and uses 1/{:.0} of torchrun's peak RSS",
        theirs.0 / ours.0,
        theirs.1 / ours.1
    );
    println!(
        "launch_ms_agent={:.2} launch_ms_torchrun={:.1} rss_mib_agent={:.1} rss_mib_torchrun={:.1}",
        ours.0, theirs.0, ours.1, theirs.1
    );
}
