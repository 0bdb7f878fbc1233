//! A "pod" for fault tests: an agent and its workers in their own PID and UTS namespaces
//! (`unshare --pid --uts --fork --kill-child`), with their own host name. SIGKILL of the
//! pod kills everything in it at once, as a node or pod death does.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::{agent_bin, wait_for};

pub struct Pod {
    pub name: String,
    child: Child,
    pub out: PathBuf,
    pub err: PathBuf,
}

impl Pod {
    /// Starts `fsdp-agent <args>` as PID 1 of a new namespace whose host name is `name`.
    pub fn start(dir: &Path, name: &str, args: &[String], env: &[(&str, String)]) -> Self {
        Self::start_in(None, dir, name, args, env)
    }

    /// As [`Pod::start`], inside the network namespace `netns` when given.
    pub fn start_in(
        netns: Option<&str>,
        dir: &Path,
        name: &str,
        args: &[String],
        env: &[(&str, String)],
    ) -> Self {
        let out = dir.join(format!("{name}.{}.stdout", unique()));
        let err = out.with_extension("stderr");
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "unshare"]);
                c
            }
            None => Command::new("unshare"),
        };
        cmd.args([
            "--pid",
            "--uts",
            "--fork",
            "--kill-child",
            "sh",
            "-c",
            "hostname \"$0\" && exec \"$@\"",
            name,
        ])
        .arg(agent_bin())
        .args(args)
        .env("RUST_LOG", "info")
        .env("FSDP_STATUS_ADDR", "127.0.0.1:0")
        .env("GLOO_SOCKET_IFNAME", "lo")
        // A direct run of the detection tests left 31 killed pods' directories in /tmp.
        .env("TMPDIR", crate::tmpdir_in(dir))
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).expect("pod stdout"))
        .stderr(std::fs::File::create(&err).expect("pod stderr"));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
            .spawn()
            .expect("unshare (util-linux) must be available and the tests run as root");
        Self {
            name: name.into(),
            child,
            out,
            err,
        }
    }

    pub fn stdout(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    pub fn output(&self) -> String {
        format!(
            "=== pod {}\n--- stdout\n{}\n--- stderr\n{}",
            self.name,
            self.stdout(),
            self.stderr()
        )
    }

    /// The agent's pid (PID 1 inside the pod), as seen from the test.
    pub fn agent_pid(&self) -> i32 {
        let children = format!("/proc/{0}/task/{0}/children", self.child.id());
        let mut pid = 0;
        wait_for("the pod's agent to start", Duration::from_secs(10), || {
            pid = std::fs::read_to_string(&children)
                .ok()
                .and_then(|s| s.split_whitespace().next().and_then(|p| p.parse().ok()))
                .unwrap_or(0);
            pid != 0
        });
        pid
    }

    /// Pod death: SIGKILL to the namespace's parent, which takes PID 1 and all with it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends `sig` to the pod's agent (a pod delete is SIGTERM).
    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(self.agent_pid());
        nix::sys::signal::kill(pid, sig).expect("signal the pod's agent");
    }

    /// The agent's exit code if the pod has ended.
    pub fn exited(&mut self) -> Option<i32> {
        self.child
            .try_wait()
            .expect("try_wait")
            .map(|s| s.code().unwrap_or(-1))
    }

    /// Waits for the pod to end and returns the agent's exit code.
    pub fn wait(&mut self, limit: Duration) -> i32 {
        let end = std::time::Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                return s.code().unwrap_or(-1);
            }
            if std::time::Instant::now() > end {
                let out = self.output();
                self.kill();
                panic!("pod {} did not exit within {limit:?}\n{out}", self.name);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        self.kill();
        crate::refuse_debug_text(&self.err);
        crate::refuse_stragglers(&self.err);
    }
}

fn unique() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    N.fetch_add(1, Ordering::Relaxed).to_string()
}
