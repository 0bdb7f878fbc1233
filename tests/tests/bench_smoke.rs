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
