use std::io::Read;
use std::os::fd::OwnedFd;
use std::path::Path;

use super::*;

fn null() -> OwnedFd {
    std::fs::File::options()
        .write(true)
        .open("/dev/null")
        .unwrap()
        .into()
}

fn sh(script: &str, env: &[(String, Option<String>)]) -> io::Result<Launched> {
    let (out, err) = (null(), null());
    start(&Launch {
        program: Path::new("sh"),
        args: &[
            "-c".to_string(),
            script.to_string(),
            "sh".into(),
            "arg".into(),
        ],
        env,
        stdout: &out,
        stderr: &err,
    })
}

async fn code(mut child: Launched) -> Option<i32> {
    child.wait().await.unwrap().code()
}

#[tokio::test]
async fn the_worker_leads_a_session_of_its_own_and_its_exit_code_comes_back() {
    // Field 6 of /proc/PID/stat is the session: the worker's own pid when it leads one.
    let child = sh(
        r#"set -- $(cat /proc/$$/stat); [ "$6" = "$$" ] && exit 7; exit 8"#,
        &[],
    )
    .unwrap();
    assert_eq!(code(child).await, Some(7));
}

#[tokio::test]
async fn the_worker_is_armed_to_die_with_the_agent() {
    let python = std::env::var("FSDP_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let (out, err) = (null(), null());
    // PR_GET_PDEATHSIG (2) reads the death signal; the exit code carries it.
    let script = "import ctypes, sys\nv = ctypes.c_int()\nctypes.CDLL(None).prctl(2, ctypes.byref(v))\nsys.exit(v.value)";
    let child = start(&Launch {
        program: Path::new(&python),
        args: &["-c".into(), script.into()],
        env: &[],
        stdout: &out,
        stderr: &err,
    })
    .unwrap();
    assert_eq!(code(child).await, Some(libc::SIGKILL));
}

#[tokio::test]
async fn arguments_and_environment_changes_reach_the_worker() {
    let env = [
        ("FSDP_LAUNCH_SET".to_string(), Some("one".to_string())),
        ("FSDP_LAUNCH_SET".to_string(), Some("two".to_string())),
        ("HOME".to_string(), None),
    ];
    let child = sh(
        r#"[ "$1" = arg ] && [ "$FSDP_LAUNCH_SET" = two ] && [ -z "${HOME+set}" ] && [ -n "$PATH" ]"#,
        &env,
    )
    .unwrap();
    assert_eq!(code(child).await, Some(0));
}

#[tokio::test]
async fn the_worker_starts_with_no_signal_blocked_and_sigpipe_not_ignored() {
    // The test runner, as the agent, ignores SIGPIPE; a worker must not inherit that. (A
    // signal ignored where the agent was started, SIGHUP under nohup, stays ignored, as
    // across any exec.)
    let child = sh(
        r#"while read k v; do case $k in SigBlk:) [ "$v" = 0000000000000000 ] || exit 9;; SigIgn:) [ $((0x$v & 0x1000)) = 0 ] || exit 10;; esac; done < /proc/$$/status"#,
        &[],
    )
    .unwrap();
    assert_eq!(code(child).await, Some(0));
}

#[tokio::test]
async fn a_signal_that_kills_the_worker_is_reported_as_such() {
    let mut child = sh("kill -TERM $$; sleep 5", &[]).unwrap();
    let status = child.wait().await.unwrap();
    assert_eq!(
        (status.code(), status.signal()),
        (None, Some(libc::SIGTERM))
    );
}

#[tokio::test]
async fn the_worker_writes_where_it_is_told() {
    let (reader, writer) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
    let err = null();
    let child = start(&Launch {
        program: Path::new("/bin/sh"),
        args: &["-c".into(), "echo hello".into()],
        env: &[],
        stdout: &writer,
        stderr: &err,
    })
    .unwrap();
    drop(writer);
    assert_eq!(code(child).await, Some(0));
    let mut got = String::new();
    std::fs::File::from(reader)
        .read_to_string(&mut got)
        .unwrap();
    assert_eq!(got, "hello\n");
}

/// The error starting `program` gives.
fn refused(program: &Path) -> io::Error {
    let (out, err) = (null(), null());
    let started = start(&Launch {
        program,
        args: &[],
        env: &[],
        stdout: &out,
        stderr: &err,
    });
    started.err().expect("the start fails")
}

#[tokio::test]
async fn a_program_that_is_not_there_or_cannot_run_is_an_error() {
    for program in ["fsdp-no-such-program", "/nonexistent/fsdp-no-such-program"] {
        let e = refused(Path::new(program));
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{program}: {e}");
    }
    // Not executable: found, and refused by the child's exec, whose errno comes back
    // through the memory the child shares (the child itself is reaped by `start`).
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("not-executable");
    std::fs::write(&script, "#!/bin/sh\n").unwrap();
    let e = refused(&script);
    assert_eq!(e.raw_os_error(), Some(libc::EACCES), "{e}");
}

#[tokio::test]
async fn a_worker_dropped_unwaited_is_killed_and_reaped() {
    let child = sh("sleep 300", &[]).unwrap();
    let pid = child.id();
    drop(child);
    let gone = std::path::PathBuf::from(format!("/proc/{pid}"));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while gone.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "worker {pid} still there"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
