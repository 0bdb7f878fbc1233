//! Install without a compiler: the wheel `scripts/dist.sh` builds goes into a
//! fresh venv with pip and runs a job with no Rust (nor any compiler) on PATH, and the
//! plain binary runs a job in a root that holds only it, glibc and `sh`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use fsdp_tests::dist::{dist, is_glibc, ldd_paths};
use fsdp_tests::{TempDir, python};

/// The job both tests run: two workers that print their global rank.
const RANK_JOB: [&str; 7] = [
    "--standalone",
    "--nproc-per-node",
    "2",
    "--no-python",
    "sh",
    "-c",
    "echo $RANK",
];

fn ok(c: &mut Command) -> Output {
    let out = c.output().unwrap_or_else(|e| panic!("{c:?}: {e}"));
    assert!(
        out.status.success(),
        "{c:?}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The ranks the workers printed, in order.
fn ranks(stdout: &[u8]) -> Vec<u32> {
    let mut r: Vec<u32> = String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    r.sort_unstable();
    r
}

#[test]
fn the_wheel_installs_with_pip_into_a_fresh_venv_and_runs_a_job_with_no_rust_on_path() {
    let wheel = dist().wheel;
    let dir = TempDir::new().unwrap();

    // PATH is the venv's bin and a directory with `sh` alone (the job's program): no
    // cargo, rustc or cc can be found, whatever this machine has in /usr/bin.
    let tools = dir.path().join("tools");
    std::fs::create_dir(&tools).unwrap();
    std::os::unix::fs::symlink("/bin/sh", tools.join("sh")).unwrap();
    let venv = dir.path().join("venv");
    let path = format!("{}:{}", venv.join("bin").display(), tools.display());
    let clean = |program: &Path| {
        let mut c = Command::new(program);
        c.env_clear()
            .env("PATH", &path)
            .env("HOME", dir.path())
            // The agent's default log directory goes with the test's (env_clear drops
            // the suite's own TMPDIR).
            .env("TMPDIR", dir.path())
            .current_dir(dir.path());
        c
    };

    // No --system-site-packages: the venv sees neither torch nor anything else installed.
    ok(clean(&python()).args(["-m", "venv"]).arg(&venv));
    let venv_python = venv.join("bin/python");
    ok(clean(&venv_python)
        .args(["-m", "pip", "install", "--no-index", "--no-deps"])
        .args(["--no-cache-dir", "--disable-pip-version-check", "--quiet"])
        .arg(&wheel));
    for d in std::env::split_paths(&path) {
        for compiler in ["cargo", "rustc", "cc"] {
            assert!(!d.join(compiler).exists(), "{compiler} in {}", d.display());
        }
    }
    let no_torch = clean(&venv_python)
        .args(["-c", "import torch"])
        .output()
        .unwrap();
    assert!(!no_torch.status.success(), "the fresh venv sees torch");

    let agent = venv.join("bin/fsdp-agent");
    assert!(
        agent.exists(),
        "the wheel put no fsdp-agent in the venv's bin"
    );
    let out = ok(clean(&agent).env("FSDP_STATUS_ADDR", "off").args(RANK_JOB));
    assert_eq!(ranks(&out.stdout), [0, 1], "{out:?}");
}

/// Copies `file` (following links) into `root` at the same absolute path.
fn copy_into(root: &Path, file: &Path) {
    let dest = root.join(file.strip_prefix("/").expect("an absolute path"));
    std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
    std::fs::copy(file, &dest).unwrap_or_else(|e| panic!("copy {}: {e}", file.display()));
}

fn libraries(program: &Path) -> Vec<PathBuf> {
    let out = ok(Command::new("ldd").arg(program));
    ldd_paths(&String::from_utf8_lossy(&out.stdout))
        .unwrap_or_else(|e| panic!("{}: {e}", program.display()))
}

#[test]
fn the_plain_binary_alone_in_a_minimal_root_runs_a_job() {
    let binary = dist().binary;
    let dir = TempDir::new().unwrap();
    let root = dir.path().join("root");

    let needs = libraries(&binary);
    let others: Vec<_> = needs.iter().filter(|l| !is_glibc(l)).collect();
    assert!(
        others.is_empty(),
        "the plain binary needs {others:?}, which glibc does not provide: an image with \
         glibc alone could not run it"
    );
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::copy(&binary, root.join("bin/fsdp-agent")).unwrap();
    // The job's program, with what it loads in turn.
    copy_into(&root, Path::new("/bin/sh"));
    for lib in needs.iter().chain(&libraries(Path::new("/bin/sh"))) {
        copy_into(&root, lib);
    }
    // The agent resolves `localhost` for MASTER_ADDR, as torchrun does; every container
    // runtime writes this file, and without it glibc has no answer.
    std::fs::create_dir(root.join("etc")).unwrap();
    std::fs::write(root.join("etc/hosts"), "127.0.0.1 localhost\n").unwrap();

    // A mount namespace of its own, so that nothing the job does reaches this machine's
    // mounts; /tmp (the agent's log dir) is created inside the root and goes with it.
    let out = ok(Command::new("unshare")
        .arg("--mount")
        .arg(format!("--root={}", root.display()))
        .arg("/bin/fsdp-agent")
        .args(RANK_JOB)
        .env_clear()
        .env("PATH", "/bin")
        .env("FSDP_STATUS_ADDR", "off"));
    assert_eq!(ranks(&out.stdout), [0, 1], "{out:?}");
}
