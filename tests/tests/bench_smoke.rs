//! The launch benchmark runs and prints its figures (one run each; the figures themselves
//! are reported in docs/benchmarks.md, never asserted as timings here).

use std::process::Command;

use fsdp_tests::{agent_bin, python};

#[test]
fn launch_benchmark_prints_its_summary_line() {
    let bench = agent_bin().with_file_name("bench-launch");
    let torchrun = python().with_file_name("torchrun");
    let out = Command::new(&bench)
        .args(["--runs", "1", "--agent"])
        .arg(agent_bin())
        .arg("--torchrun")
        .arg(&torchrun)
        .output()
        .expect("run bench-launch");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout.lines().last().unwrap_or_default();
    for key in [
        "launch_ms_agent=",
        "launch_ms_torchrun=",
        "rss_mib_agent=",
        "rss_mib_torchrun=",
    ] {
        assert!(last.contains(key), "{key} missing from: {last}");
    }
}

#[test]
fn rendezvous_benchmark_prints_its_summary_line() {
    let etcd = fsdp_tests::etcd::Etcd::start();
    let bench = agent_bin().with_file_name("rdzv-bench");
    let out = Command::new(&bench)
        .args(["--endpoint", &etcd.endpoint(), "--nodes", "8"])
        .output()
        .expect("run rdzv-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout.lines().last().unwrap_or_default();
    assert!(last.starts_with("nodes=8 seal_s="), "{last}");
    let writes: u64 = last
        .rsplit_once("etcd_writes=")
        .expect("writes")
        .1
        .parse()
        .expect("a count");
    // Two per node (lease, registration) plus the round commit and the master key.
    assert!(writes <= 3 * 8, "{writes} writes for 8 nodes");
}
