//! Test harness for fsdp-agent: run the real agent binary with real workers and inspect
//! what they did.
//!
//! The agent binary is built by `cargo build` (the test script does it first) and found
//! next to this crate's binaries in the target directory. The Python interpreter with
//! torch comes from `FSDP_TEST_PYTHON`, or the venv the set-up script creates.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub use tempfile::TempDir;

pub mod dist;
pub mod etcd;
pub mod etcd_cluster;
pub mod job;
pub mod netns;
pub mod pod;
pub mod slurm;

/// The target directory holding the workspace binaries of the current profile.
fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let mut dir = exe.parent().expect("exe dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir
}

/// Path of the `fsdp-agent` binary under test.
pub fn agent_bin() -> PathBuf {
    let p = bin_dir().join("fsdp-agent");
    assert!(
        p.exists(),
        "{} is missing: run `cargo build --workspace` before the tests",
        p.display()
    );
    p
}

/// Agent flags that keep several workers' lines whole on the console: by default workers
/// share the agent's stream unprefixed, as under torchrun, and an unbuffered Python
/// `print` is two writes, so lines of two ranks can interleave. Tests that parse
/// per-rank lines ask for prefixes, as a user who parses output would.
pub const WHOLE_LINES: [&str; 2] = ["--log-line-prefix-template", "[${role_name}${local_rank}]:"];

/// Runs `fsdp-agent status ARGS` with no `PET_RDZV_*` inherited from the test's own
/// environment: (exit code, stdout, stderr).
pub fn status_cmd(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(agent_bin())
        .arg("status")
        .args(args)
        .env_remove("PET_RDZV_ENDPOINT")
        .env_remove("PET_RDZV_ID")
        .env_remove("PET_RDZV_CONF")
        .output()
        .expect("run fsdp-agent status");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    // The whole of status's table is for a person (its JSON is for programs).
    if !args.contains(&"--json") {
        for text in [&stdout, &stderr] {
            let found: Vec<&str> = text
                .lines()
                .filter(|l| DEBUG_TEXT.iter().any(|d| l.contains(d)))
                .collect();
            assert!(
                found.is_empty(),
                "fsdp-agent status printed Rust debug text:\n{}",
                found.join("\n")
            );
        }
    }
    (out.status.code().expect("exit code"), stdout, stderr)
}

/// Path of the `fake-worker` helper.
pub fn fake_worker() -> PathBuf {
    let p = bin_dir().join("fake-worker");
    assert!(
        p.exists(),
        "{} is missing: run `cargo build --workspace` before the tests",
        p.display()
    );
    p
}

/// The Python interpreter that has torch installed.
pub fn python() -> PathBuf {
    let p = std::env::var_os("FSDP_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| "/root".into());
            home.join(".cache/fsdp-agent/venv/bin/python")
        });
    assert!(
        p.exists(),
        "{} is missing: run scripts/setup.sh (or set FSDP_TEST_PYTHON)",
        p.display()
    );
    p
}

/// The `TMPDIR` for the processes a test starts: `dir/tmp`, created. What a launcher
/// keeps there when given no log directory (ours `fsdp-agent-*`, torchrun's
/// `torchelastic_*`), and what a killed one cannot remove, goes with the test's own
/// directory instead of staying in /tmp.
pub fn tmpdir_in(dir: &Path) -> PathBuf {
    let tmp = dir.join("tmp");
    std::fs::create_dir_all(&tmp).expect("a TMPDIR in the test's directory");
    tmp
}

/// A file in the workspace, e.g. `tests/py/raise_with_record.py` or `examples/allreduce.py`.
pub fn workspace_file(rel: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel);
    assert!(p.exists(), "{} is missing", p.display());
    p
}

/// The arguments that run the `fake-worker` helper under the agent, recording into `dir`.
pub fn fake_worker_args(dir: &Path, extra: &[&str]) -> Vec<String> {
    let mut v = vec![
        "--no-python".to_owned(),
        fake_worker().display().to_string(),
        "--dir".into(),
        dir.display().to_string(),
    ];
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// A running agent with its output captured to files.
pub struct Agent {
    pub child: Child,
    pub out: PathBuf,
    pub err: PathBuf,
    status: Option<ExitStatus>,
    /// The test slows a node on purpose: its agents may name a straggler.
    stragglers: bool,
}

/// Builder for an agent invocation.
pub struct AgentCmd {
    cmd: Command,
    dir: PathBuf,
    name: String,
    stragglers: bool,
}

impl AgentCmd {
    /// An agent whose captured output lives in `dir` under `name`.
    pub fn new(dir: &Path, name: &str) -> Self {
        Self::from_command(Command::new(agent_bin()), dir, name)
    }

    /// An agent whose soft open-file limit is `nofile` (as `ulimit -n` in a container),
    /// through util-linux's `prlimit`.
    pub fn with_nofile(dir: &Path, name: &str, nofile: u64) -> Self {
        let mut cmd = Command::new("prlimit");
        cmd.arg(format!("--nofile={nofile}:"))
            .arg("--")
            .arg(agent_bin());
        Self::from_command(cmd, dir, name)
    }

    fn from_command(mut cmd: Command, dir: &Path, name: &str) -> Self {
        // Keep the tests independent of the caller's environment.
        for (k, _) in std::env::vars() {
            if k.starts_with("PET_") || k.starts_with("TORCHELASTIC_") || k == "OMP_NUM_THREADS" {
                cmd.env_remove(k);
            }
        }
        // Many agents run at once here: each gets its own status port.
        cmd.env("RUST_LOG", "info")
            .env("FSDP_STATUS_ADDR", "127.0.0.1:0")
            .stdin(Stdio::null());
        // Each run of the suite left dozens of /tmp/fsdp-agent-* behind (its logs, its
        // progress files). A test that means another TMPDIR sets it after.
        cmd.env("TMPDIR", tmpdir_in(dir));
        Self {
            cmd,
            dir: dir.to_path_buf(),
            name: name.into(),
            stragglers: false,
        }
    }

    /// The test slows a node on purpose: this agent may name a straggler. Every other
    /// agent of the suite is checked, when dropped, never to have named one: the whole
    /// suite on a loaded machine is the test that noise names nobody.
    pub fn naming_stragglers(mut self) -> Self {
        self.stragglers = true;
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        self.cmd.args(args);
        self
    }

    pub fn arg(mut self, a: impl AsRef<std::ffi::OsStr>) -> Self {
        self.cmd.arg(a);
        self
    }

    pub fn arg_path(mut self, p: impl AsRef<Path>) -> Self {
        self.cmd.arg(p.as_ref());
        self
    }

    pub fn current_dir(mut self, dir: impl AsRef<Path>) -> Self {
        self.cmd.current_dir(dir);
        self
    }

    pub fn env(mut self, k: &str, v: impl AsRef<std::ffi::OsStr>) -> Self {
        self.cmd.env(k, v);
        self
    }

    pub fn spawn(mut self) -> Agent {
        let out = self.dir.join(format!("{}.stdout", self.name));
        let err = self.dir.join(format!("{}.stderr", self.name));
        self.cmd
            .stdout(std::fs::File::create(&out).expect("stdout file"))
            .stderr(std::fs::File::create(&err).expect("stderr file"));
        let child = self.cmd.spawn().expect("spawn fsdp-agent");
        Agent {
            child,
            out,
            err,
            status: None,
            stragglers: self.stragglers,
        }
    }

    /// Runs to completion (at most `limit`) and returns the agent.
    pub fn run(self, limit: Duration) -> Agent {
        let mut a = self.spawn();
        a.wait(limit);
        a
    }
}

impl Agent {
    /// The address the agent's status server bound, from its log line (waits for it).
    pub fn status_addr(&self) -> String {
        let mut addr = String::new();
        wait_for(
            "the status server's log line",
            Duration::from_secs(60),
            || {
                let err = self.stderr();
                if let Some(line) = err.lines().find(|l| l.contains("status server listening")) {
                    addr = line
                        .split_whitespace()
                        .find_map(|w| w.strip_prefix("addr="))
                        .expect("addr= in the line")
                        .to_owned();
                    return true;
                }
                false
            },
        );
        addr
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Waits for the agent to exit; panics with its output if it takes longer than `limit`.
    pub fn wait(&mut self, limit: Duration) -> ExitStatus {
        if let Some(s) = self.status {
            return s;
        }
        let end = Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                self.status = Some(s);
                return s;
            }
            if Instant::now() > end {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "agent did not exit within {limit:?}\n--- stdout\n{}\n--- stderr\n{}",
                    self.stdout(),
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The exit code (panics if the agent was killed by a signal).
    pub fn code(&mut self) -> i32 {
        let s = self.wait(Duration::from_secs(120));
        s.code()
            .unwrap_or_else(|| panic!("agent died by a signal: {s:?}\n{}", self.stderr()))
    }

    pub fn stdout(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    /// Both streams, for assertion messages.
    pub fn output(&self) -> String {
        format!(
            "--- stdout\n{}\n--- stderr\n{}",
            self.stdout(),
            self.stderr()
        )
    }

    pub fn signal(&self, sig: libc::c_int) {
        // SAFETY-free: nix wrapper.
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid()),
            nix::sys::signal::Signal::try_from(sig).expect("signal"),
        )
        .expect("signal the agent");
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        refuse_debug_text(&self.err);
        if !self.stragglers {
            refuse_stragglers(&self.err);
        }
    }
}

/// An agent of a test that slows no node named a straggler: noise named somebody (the
/// judge's margins are too thin for a loaded machine).
pub fn refuse_stragglers(log_file: &Path) {
    if std::thread::panicking() {
        return;
    }
    let log = std::fs::read_to_string(log_file).unwrap_or_default();
    let named: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("a straggler:") && is_agent_line(l))
        .collect();
    assert!(
        named.is_empty(),
        "the agent named a straggler in a test that slows no node ({}):\n{}",
        log_file.display(),
        named.join("\n")
    );
}

/// What Rust's `{:?}` leaves in a line meant for a person (`Some("vm-7")`, `None,`).
const DEBUG_TEXT: [&str; 3] = ["Some(", "None,", "Err("];

/// The lines of `log` the agent wrote for a person (its log lines and its `error:`
/// lines, not its workers' output) that hold Rust debug text.
pub fn debug_text_in(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| is_agent_line(l))
        .filter(|l| DEBUG_TEXT.iter().any(|d| l.contains(d)))
        .collect()
}

/// A line the agent printed: a text log line (`2026-11-28T06:14:10.265022Z  WARN ...`)
/// or one of its error lines.
fn is_agent_line(line: &str) -> bool {
    let stamped = line.len() > 28
        && line.as_bytes()[..4].iter().all(u8::is_ascii_digit)
        && line.as_bytes()[10] == b'T'
        && ["  INFO ", "  WARN ", " ERROR ", " DEBUG ", " TRACE "]
            .iter()
            .any(|level| line[..40.min(line.len())].contains(level));
    stamped
        || line.starts_with("fsdp-agent: error:")
        || line.starts_with("fsdp-agent status: error:")
}

/// Every agent a test starts is checked when it is dropped, so that the suite's runs
/// together say no line the agent prints holds Rust debug text (a test that already
/// failed is left to say why it did).
pub fn refuse_debug_text(log_file: &Path) {
    if std::thread::panicking() {
        return;
    }
    let log = std::fs::read_to_string(log_file).unwrap_or_default();
    let found = debug_text_in(&log);
    assert!(
        found.is_empty(),
        "the agent printed Rust debug text for a person to read ({}):\n{}",
        log_file.display(),
        found.join("\n")
    );
}

/// [`wait_for`], and on the timeout the panic shows `shown()` (the agents' logs).
pub fn wait_showing(
    what: &str,
    limit: Duration,
    mut cond: impl FnMut() -> bool,
    shown: impl FnOnce() -> String,
) {
    if !held_within(limit, &mut cond) {
        panic!("timed out after {limit:?} waiting for {what}\n{}", shown());
    }
}

/// Polls `cond` every 10 ms until it holds; panics naming `what` after `limit`.
pub fn wait_for(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    assert!(
        held_within(limit, &mut cond),
        "timed out after {limit:?} waiting for {what}"
    );
}

/// Whether `cond`, polled every 10 ms, held within `limit`.
fn held_within(limit: Duration, cond: &mut impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while !cond() {
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

/// Stops (SIGSTOP) or continues (SIGCONT) a pod: an agent and its workers, in the order
/// that keeps every worker there to be signalled. The agent is stopped first, so it
/// signals and reaps none of them meanwhile, and continued last, as a freezer that thaws
/// a whole pod at once would have it: an agent continued first may find its lease gone
/// and kill its workers at once (its grace is cut past the lease), before they are
/// continued.
pub fn signal_pod(agent: i32, workers: &[i32], sig: nix::sys::signal::Signal) {
    let agent = std::iter::once(&agent);
    let order: Vec<&i32> = if sig == nix::sys::signal::Signal::SIGCONT {
        workers.iter().chain(agent).collect()
    } else {
        agent.chain(workers).collect()
    };
    for pid in order {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), sig)
            .unwrap_or_else(|e| panic!("{sig} to {pid}: {e}"));
    }
}

/// Whether a process with this pid exists (and is not a zombie).
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // The state follows the parenthesised command name.
            let state = stat
                .rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().chars().next());
            !matches!(state, Some(Some('Z')) | Some(Some('X')))
        }
        Err(_) => false,
    }
}

/// Reads the records fake workers wrote with a given prefix: suffix → contents.
pub fn records(dir: &Path, prefix: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).expect("read records dir").flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(rest) = name.strip_prefix(&format!("{prefix}.")) {
            out.insert(
                rest.to_owned(),
                std::fs::read_to_string(e.path()).unwrap_or_default(),
            );
        }
    }
    out
}

/// The environment a fake worker recorded for (restart, rank).
pub fn worker_env(dir: &Path, restart: u32, rank: u32) -> BTreeMap<String, String> {
    let path = dir.join(format!("env.{restart}.{rank}"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: serde_json::Value = serde_json::from_str(&text).expect("env json");
    v.as_object()
        .expect("object")
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
        .collect()
}

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// Whether process `pid` holds a socket listening on 127.0.0.1:`port` (or on every
/// address): found in `/proc/net/tcp` by the socket's inode, and that inode among the
/// process's open files. A connect to the port only says that some process listens there.
pub fn listens_on(pid: u32, port: u16) -> bool {
    let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else {
        return false;
    };
    // Columns: sl local_address rem_address st ... inode; addresses as hex IP:port, the
    // IP in host byte order; state 0A is LISTEN.
    let inodes: Vec<String> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let (ip, p) = cols.get(1)?.split_once(':')?;
            let ours = u16::from_str_radix(p, 16).ok()? == port
                && matches!(ip, "0100007F" | "00000000")
                && *cols.get(3)? == "0A";
            let inode = cols.get(9)?;
            ours.then(|| format!("socket:[{inode}]"))
        })
        .collect();
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path())
            .is_ok_and(|l| inodes.iter().any(|i| l.as_os_str() == i.as_str()))
    })
}

/// `GET /metrics` from the status port at `addr`: the whole HTTP response, checked to be a
/// 200.
pub fn metrics_text(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect to /metrics");
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    resp
}

#[cfg(test)]
mod debug_text_tests {
    use super::debug_text_in;

    #[test]
    fn only_the_agents_own_lines_are_judged() {
        let log = "\
2026-11-28T06:14:10.265022Z ERROR fsdp-agent: error: x
2026-11-28T06:14:10.265022Z  INFO coordinator reason=round Some(3)
fsdp-agent: error: no round formed within join_timeout (8s): round None, coordinator Some(\"vm\")
[0]: (None, 3)
print(Err(x))
2026-11-28T06:14:10.265022Z  WARN all fine here
";
        assert_eq!(
            debug_text_in(log),
            [
                "2026-11-28T06:14:10.265022Z  INFO coordinator reason=round Some(3)",
                "fsdp-agent: error: no round formed within join_timeout (8s): round None, coordinator Some(\"vm\")"
            ]
        );
    }
}
