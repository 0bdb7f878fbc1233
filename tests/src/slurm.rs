//! The real three-node Slurm cluster of scripts/slurm (Debian's slurmctld, slurmd and
//! munge; nodes n1..n3 in their own UTS and mount namespaces on this machine). A test that
//! starts it owns it until dropped, which stops it with every job and removes its state;
//! the Slurm tests run one at a time (nextest group `slurm-cluster`).
//!
//! A cluster that cannot start is a failure with the scripts' output, never a skip.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use crate::{agent_bin, python};

/// The running cluster.
pub struct Cluster {
    conf: PathBuf,
    /// The jobs' `TMPDIR`: the agents' default log directories go there and are removed
    /// with the cluster.
    tmp: crate::TempDir,
}

fn script(name: &str) -> PathBuf {
    crate::workspace_file(&format!("scripts/slurm/{name}"))
}

fn run_script(name: &str, args: &[&str]) -> Output {
    Command::new("bash")
        .arg(script(name))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run scripts/slurm/{name}: {e}"))
}

impl Cluster {
    /// Starts the cluster (or takes over one left running) with every node up.
    pub fn start() -> Self {
        let out = run_script("start.sh", &[]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "the Slurm test cluster did not start (scripts/setup.sh installs slurmctld slurmd slurm-client munge; run as root):\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let conf = stdout
            .lines()
            .find_map(|l| l.strip_prefix("export SLURM_CONF="))
            .unwrap_or_else(|| panic!("start.sh printed no SLURM_CONF: {stdout}"));
        let cluster = Self {
            conf: conf.trim().into(),
            tmp: crate::TempDir::new().expect("a temporary directory for the jobs"),
        };
        // A cluster left by a crashed test may still hold its jobs.
        let _ = cluster.client("scancel").args(["--user", "root"]).status();
        cluster
    }

    /// Starts again the nodes that `kill_node` killed (the controller and its jobs stay).
    pub fn start_lost_nodes(&self) {
        let out = run_script("start.sh", &[]);
        assert!(
            out.status.success(),
            "start.sh: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A Slurm client command (`srun`, `scontrol`, ...) for this cluster, with none of the
    /// test's own `SLURM_*` variables (CI itself may run under Slurm).
    pub fn client(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("SLURM_") {
                cmd.env_remove(k);
            }
        }
        cmd.env("SLURM_CONF", &self.conf).stdin(Stdio::null());
        cmd
    }

    /// `srun` with `srun_args`, then the agent with `agent_args`: the workers' Python is
    /// the test venv's, gloo on the loopback (the nodes share it), the agent logs at info.
    pub fn srun_agent(&self, srun_args: &[&str], agent_args: &[String]) -> Command {
        let mut cmd = self.job_client("srun");
        cmd.args(srun_args).arg(agent_bin()).args(agent_args);
        cmd
    }

    /// A client whose jobs run agents (`srun`, `sbatch`: the job inherits its
    /// environment): the venv's Python first on `PATH`, gloo on the loopback,
    /// `FSDP_AGENT` the agent under test, no `PET_*` rendezvous values of the test's own.
    pub fn job_client(&self, program: &str) -> Command {
        let mut cmd = self.client(program);
        let venv_bin = python().parent().expect("venv bin").to_path_buf();
        let path = std::env::var_os("PATH").unwrap_or_default();
        let path =
            std::env::join_paths(std::iter::once(venv_bin).chain(std::env::split_paths(&path)))
                .expect("PATH");
        cmd.env("PATH", path)
            .env("FSDP_AGENT", agent_bin())
            .env("TMPDIR", self.tmp.path())
            .env("GLOO_SOCKET_IFNAME", "lo")
            .env("RUST_LOG", "info")
            .env_remove("PET_RDZV_ENDPOINT")
            .env_remove("PET_RDZV_ID")
            .env_remove("PET_NNODES");
        cmd
    }

    /// The ID of the job named `name`.
    pub fn job_id(&self, name: &str) -> String {
        Self::field(&self.job(name), "JobId").to_owned()
    }

    /// `scontrol show job` of the job named `name`, one line (`-o`).
    pub fn job(&self, name: &str) -> String {
        self.job_where(&format!("JobName={name}"))
    }

    /// `scontrol show job` of the job `id`, one line.
    pub fn job_by_id(&self, id: &str) -> String {
        self.job_where(&format!("JobId={id}"))
    }

    fn job_where(&self, field: &str) -> String {
        let out = self
            .client("scontrol")
            .args(["-o", "show", "job"])
            .output()
            .expect("scontrol");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find(|l| l.split_whitespace().any(|f| f == field))
            .unwrap_or_else(|| panic!("no job with {field} in scontrol show job"))
            .to_owned()
    }

    /// Waits until the job named `name` has ended (COMPLETED, FAILED, CANCELLED, ...) and
    /// returns its `scontrol -o show job` line.
    pub fn wait_job(&self, name: &str, limit: std::time::Duration) -> String {
        let end = std::time::Instant::now() + limit;
        loop {
            let job = self.job(name);
            let state = Self::field(&job, "JobState");
            // SIGNALING is Slurm delivering a `--signal` to a running job (seen under load:
            // the job was read while its batch shell was being warned), not an end.
            if !matches!(
                state,
                "PENDING"
                    | "RUNNING"
                    | "CONFIGURING"
                    | "COMPLETING"
                    | "REQUEUED"
                    | "REQUEUE_HOLD"
                    | "SIGNALING"
            ) {
                return job;
            }
            assert!(
                std::time::Instant::now() < end,
                "job {name} still {state} after {limit:?}: {job}"
            );
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }

    /// Waits until the job `id` is in `state` (e.g. PENDING once requeued).
    pub fn wait_state(&self, id: &str, state: &str, limit: std::time::Duration) {
        let end = std::time::Instant::now() + limit;
        loop {
            let job = self.job_by_id(id);
            if Self::field(&job, "JobState") == state {
                return;
            }
            assert!(
                std::time::Instant::now() < end,
                "job {id} not {state} after {limit:?}: {job}"
            );
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }

    /// A field of a `scontrol -o show job` line, e.g. `ExitCode` or `JobState`.
    pub fn field<'a>(job: &'a str, key: &str) -> &'a str {
        job.split_whitespace()
            .find_map(|f| f.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("no {key} in {job}"))
    }

    /// A node death: every process of `node` (n1, n2, n3) killed at once, its slurmd too.
    pub fn kill_node(&self, node: &str) {
        let out = run_script("kill-node.sh", &[node]);
        assert!(
            out.status.success(),
            "kill-node.sh {node}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let out = run_script("stop.sh", &[]);
        if !out.status.success() {
            eprintln!(
                "scripts/slurm/stop.sh failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}
