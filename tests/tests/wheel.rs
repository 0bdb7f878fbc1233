//! `pip install fsdp-agent`: the wheel `scripts/dist.sh` builds (maturin, `bin`
//! bindings) puts the binary in an environment's bin, beside its python; installed in a
//! fresh venv with torch, `venv/bin/fsdp-agent` runs a two-worker job with no venv
//! activated and no python of that venv on PATH.

use std::process::Command;

use fsdp_tests::dist::dist;
use fsdp_tests::{TempDir, python, workspace_file};

#[test]
fn the_wheel_installs_into_a_venv_whose_python_then_runs_the_workers() {
    let dir = TempDir::new().unwrap();
    let cached = python();
    let wheel = dist().wheel;

    // A fresh venv on the same interpreter; torch reaches it through a .pth file (no
    // download), as if it had been installed there.
    let venv = dir.path().join("venv");
    let ok = |c: &mut Command| {
        let out = c.output().unwrap();
        assert!(
            out.status.success(),
            "{c:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    ok(Command::new(&cached)
        .args(["-m", "venv", "--without-pip"])
        .arg(&venv));
    let venv_python = venv.join("bin/python");
    let site = |py: &std::path::Path| {
        ok(Command::new(py).args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ]))
    };
    std::fs::write(
        std::path::Path::new(&site(&venv_python)).join("torch-from-cache.pth"),
        format!("{}\n", site(&cached)),
    )
    .unwrap();
    ok(Command::new(&cached)
        .args(["-m", "pip", "--python"])
        .arg(&venv_python)
        .args(["install", "--quiet", "--no-deps", "--no-index"])
        .arg(&wheel));
    let agent = venv.join("bin/fsdp-agent");
    assert!(
        agent.exists(),
        "the wheel put no fsdp-agent in the venv's bin"
    );

    let out = Command::new(&agent)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("FSDP_STATUS_ADDR", "off")
        .env("TMPDIR", std::env::temp_dir())
        .args(["--standalone", "--nproc-per-node", "2"])
        .arg(workspace_file("examples/allreduce.py"))
        .current_dir(dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(
        stdout.matches("all_reduce sum = 3 (expected 3)").count(),
        2,
        "{stdout}"
    );
}
