//! Worker output: console prefixes, --redirects/--tee files per attempt, rank filters.

use std::path::{Path, PathBuf};
use std::time::Duration;

use fsdp_tests::{AgentCmd, TempDir};

const LIMIT: Duration = Duration::from_secs(60);

/// Two workers print one stdout and one stderr line each, naming their rank.
fn run(dir: &Path, extra: &[&str]) -> fsdp_tests::Agent {
    let mut a = AgentCmd::new(dir, "agent")
        .args(["--standalone", "--nproc-per-node", "2", "--log-dir"])
        .arg_path(dir.join("logs"))
        .args(extra)
        .args([
            "--no-python",
            "sh",
            "-c",
            "echo out-$RANK loss=1; echo err-$RANK >&2",
        ])
        .run(LIMIT);
    assert_eq!(a.code(), 0, "{}", a.output());
    a
}

/// `<log-dir>/<run_id>_<rand>/attempt_0`.
fn attempt0(dir: &Path) -> PathBuf {
    let run = std::fs::read_dir(dir.join("logs"))
        .unwrap()
        .next()
        .expect("run dir")
        .unwrap()
        .path();
    run.join("attempt_0")
}

/// Without -r/-t or a prefix template the workers write to the agent's own stdout and
/// stderr, unprefixed, as under torchrun; a template asks for prefixes.
#[test]
fn console_lines_are_the_workers_own_unless_a_prefix_is_asked_for() {
    let dir = TempDir::new().unwrap();
    let a = run(dir.path(), &[]);
    let (out, err) = (a.stdout(), a.stderr());
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines.contains(&"out-0 loss=1") && lines.contains(&"out-1 loss=1"),
        "{out}"
    );
    assert!(
        err.lines().any(|l| l == "err-0") && err.lines().any(|l| l == "err-1"),
        "{err}"
    );
    // Without -r/-t no stream files are written, only the per-rank dirs for error files.
    assert!(!attempt0(dir.path()).join("0/stdout.log").exists());
    let a = run(
        dir.path(),
        &["--log-line-prefix-template", "[${role_name}${local_rank}]:"],
    );
    let out = a.stdout();
    assert!(
        out.contains("[default0]:out-0 loss=1") && out.contains("[default1]:out-1 loss=1"),
        "{out}"
    );
}

/// Under a terminal the workers see a terminal (colours, progress bars and pdb work), and
/// read the agent's stdin.
#[test]
fn workers_inherit_the_terminal_and_stdin() {
    let dir = TempDir::new().unwrap();
    let agent = fsdp_tests::agent_bin();
    let inner = format!(
        "echo typed | {} --standalone --status-addr off --no-python sh -c \
         'test -t 2 && echo stderr-is-a-tty; read line; echo read=$line'",
        agent.display()
    );
    // util-linux `script` runs the command on a fresh pseudo-terminal.
    let out = std::process::Command::new("script")
        .args(["-qec", &inner, "/dev/null"])
        .current_dir(dir.path())
        .stdin(std::process::Stdio::null())
        .output()
        .expect("script (util-linux)");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("stderr-is-a-tty"), "{text}");
    assert!(text.contains("read=typed"), "{text}");
}

#[test]
fn redirects_send_streams_to_files_only() {
    let dir = TempDir::new().unwrap();
    let a = run(dir.path(), &["--redirects", "1"]);
    let att = attempt0(dir.path());
    for r in 0..2 {
        let f = std::fs::read_to_string(att.join(format!("{r}/stdout.log"))).unwrap();
        assert_eq!(f, format!("out-{r} loss=1\n"));
    }
    assert!(!a.stdout().contains("out-"), "{}", a.stdout());
    assert!(
        a.stderr().lines().any(|l| l == "err-1"),
        "stderr was redirected too"
    );
}

#[test]
fn tee_per_rank_writes_files_and_echoes() {
    let dir = TempDir::new().unwrap();
    let a = run(
        dir.path(),
        &["-t", "0:3", "--duplicate-stdout-filters", "loss="],
    );
    let att = attempt0(dir.path());
    assert_eq!(
        std::fs::read_to_string(att.join("0/stdout.log")).unwrap(),
        "out-0 loss=1\n"
    );
    assert_eq!(
        std::fs::read_to_string(att.join("0/stderr.log")).unwrap(),
        "err-0\n"
    );
    assert!(!att.join("1/stdout.log").exists(), "rank 1 was not tee'd");
    // The tee'd rank is echoed with its prefix; the other is the agent's own stream.
    let out = a.stdout();
    assert!(
        out.contains("[default0]:out-0") && out.lines().any(|l| l == "out-1 loss=1"),
        "{out}"
    );
    assert_eq!(
        std::fs::read_to_string(att.join("filtered_stdout.log")).unwrap(),
        "out-0 loss=1\n"
    );
}

/// torchrun's `--local-ranks-filter` alone: the ranks it keeps write to the agent's own
/// stream, unprefixed; the others to nothing.
#[test]
fn local_ranks_filter_alone_shows_the_kept_ranks_bare() {
    let dir = TempDir::new().unwrap();
    let a = run(dir.path(), &["--local-ranks-filter", "0"]);
    let (out, err) = (a.stdout(), a.stderr());
    assert!(out.lines().any(|l| l == "out-0 loss=1"), "{out}");
    assert!(err.lines().any(|l| l == "err-0"), "{err}");
    assert!(
        !out.contains("out-1") && !err.contains("err-1"),
        "{out}{err}"
    );
    assert!(!out.contains("[default"), "{out}");
}

#[test]
fn local_ranks_filter_and_prefix_template() {
    let dir = TempDir::new().unwrap();
    let a = run(
        dir.path(),
        &[
            "--local-ranks-filter",
            "1",
            "--log-line-prefix-template",
            "<${role_name}|${rank}>",
        ],
    );
    let out = a.stdout();
    assert!(out.contains("<default|1>out-1"), "{out}");
    assert!(!out.contains("out-0"), "{out}");
}

#[test]
fn log_dir_dev_null_means_no_files_and_an_empty_error_file_variable() {
    let dir = TempDir::new().unwrap();
    let mut a = AgentCmd::new(dir.path(), "agent")
        .args([
            "--standalone",
            "--log-dir",
            "/dev/null",
            "--no-python",
            "sh",
            "-c",
            "echo \"[$TORCHELASTIC_ERROR_FILE]\"",
        ])
        .run(LIMIT);
    assert_eq!(a.code(), 0, "{}", a.output());
    assert!(a.stdout().lines().any(|l| l == "[]"), "{}", a.stdout());
}
