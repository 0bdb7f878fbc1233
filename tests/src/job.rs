//! An elastic job for fault tests: a real etcd (or, for `--rdzv-backend c10d`, the store
//! pod 0's agent serves), a shared checkpoint directory, and "pods"
//! (an agent with its workers in their own PID and UTS namespace, optionally in their own
//! network namespace) running `tests/py/elastic_worker.py`: real PyTorch gloo workers that
//! all-reduce in a loop and checkpoint a step counter.

use std::time::Duration;

use crate::etcd::Etcd;
use crate::netns::Host;
use crate::pod::Pod;
use crate::{TempDir, python, status_cmd, workspace_file};

/// How long a fault test waits for anything.
pub const LIMIT: Duration = Duration::from_secs(90);

/// Where a job's rendezvous lives.
pub enum Rdzv {
    Etcd(Etcd),
    /// `--rdzv-backend c10d` with this endpoint: pod 0's address, so pod 0's agent serves
    /// the store when it starts first.
    C10d(String),
}

/// One job: its rendezvous, a checkpoint directory and the agent flags every pod shares.
pub struct Job {
    pub rdzv: Rdzv,
    pub dir: TempDir,
    pub run_id: String,
    pub nnodes: String,
    pub max_restarts: u32,
    pub steps: u32,
    pub net: u8,
    /// The `--rdzv-conf` every pod gets.
    pub rdzv_conf: String,
    /// More agent flags every pod gets (e.g. `--prewarm`).
    pub agent_flags: Vec<String>,
}

/// A worker's `start` line: what the group looked like when it began.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Start {
    pub world: u32,
    pub step: u32,
    pub restart: u32,
}

impl Job {
    pub fn new(run_id: &str, nnodes: &str, max_restarts: u32, steps: u32, net: u8) -> Self {
        Self::with_etcd(Etcd::start(), run_id, nnodes, max_restarts, steps, net)
    }

    /// A job on `etcd` (e.g. one that also listens on a test bridge).
    pub fn with_etcd(
        etcd: Etcd,
        run_id: &str,
        nnodes: &str,
        max_restarts: u32,
        steps: u32,
        net: u8,
    ) -> Self {
        Self::with_rdzv(Rdzv::Etcd(etcd), run_id, nnodes, max_restarts, steps, net)
    }

    fn with_rdzv(
        rdzv: Rdzv,
        run_id: &str,
        nnodes: &str,
        max_restarts: u32,
        steps: u32,
        net: u8,
    ) -> Self {
        Self {
            rdzv,
            dir: TempDir::new().unwrap(),
            run_id: run_id.into(),
            nnodes: nnodes.into(),
            max_restarts,
            steps,
            net,
            rdzv_conf: "last_call_timeout=1,keep_alive_ttl=2".into(),
            agent_flags: Vec::new(),
        }
    }

    /// A job on `--rdzv-backend c10d`: no etcd at all; pod 0 serves the store.
    pub fn c10d(run_id: &str, nnodes: &str, max_restarts: u32, steps: u32, net: u8) -> Self {
        let endpoint = format!("127.0.{net}.1:{}", crate::free_port());
        Self::with_rdzv(
            Rdzv::C10d(endpoint),
            run_id,
            nnodes,
            max_restarts,
            steps,
            net,
        )
    }

    /// The job's etcd; a c10d job has none.
    pub fn etcd(&self) -> &Etcd {
        match &self.rdzv {
            Rdzv::Etcd(e) => e,
            Rdzv::C10d(_) => panic!("a c10d job has no etcd"),
        }
    }

    pub fn etcd_mut(&mut self) -> &mut Etcd {
        match &mut self.rdzv {
            Rdzv::Etcd(e) => e,
            Rdzv::C10d(_) => panic!("a c10d job has no etcd"),
        }
    }

    /// `--rdzv-endpoint` as pods on loopback give it.
    pub fn endpoint(&self) -> String {
        match &self.rdzv {
            Rdzv::Etcd(e) => e.endpoint(),
            Rdzv::C10d(endpoint) => endpoint.clone(),
        }
    }

    /// Pod `index` on this machine's loopback, at `127.0.<net>.<index + 1>`.
    pub fn pod(&self, index: u8, extra: &[&str]) -> Pod {
        let addr = format!("127.0.{}.{}", self.net, index + 1);
        let args = self.args(&self.endpoint(), &addr, extra);
        let env = [("PYTHON", python().display().to_string())];
        Pod::start(self.dir.path(), &format!("pod{index}"), &args, &env)
    }

    /// Pod `index` on `host`, a network namespace: it reaches etcd at `etcd_addr` and its
    /// peers over the host's link.
    pub fn pod_on(&self, host: &Host, etcd_addr: &str, index: u8, extra: &[&str]) -> Pod {
        let args = self.args(&self.etcd().endpoint_on(etcd_addr), &host.addr, extra);
        let env = [
            ("PYTHON", python().display().to_string()),
            ("GLOO_SOCKET_IFNAME", "eth0".to_string()),
            // On every address, so that peers reach it at the host's (ring liveness).
            ("FSDP_STATUS_ADDR", "0.0.0.0:0".to_string()),
        ];
        let name = format!("pod{index}");
        Pod::start_in(Some(&host.ns), self.dir.path(), &name, &args, &env)
    }

    fn args(&self, endpoint: &str, addr: &str, extra: &[&str]) -> Vec<String> {
        let mut args = self.agent_args(endpoint, addr, "1");
        args.push(
            workspace_file("tests/py/elastic_worker.py")
                .display()
                .to_string(),
        );
        args.push(self.dir.path().join("ckpt").display().to_string());
        args.push(self.steps.to_string());
        args.extend(extra.iter().map(|s| s.to_string()));
        std::fs::create_dir_all(self.dir.path().join("ckpt")).unwrap();
        args
    }

    /// The agent's flags for this job, up to the entrypoint.
    fn agent_args(&self, endpoint: &str, addr: &str, nproc: &str) -> Vec<String> {
        let backend = match self.rdzv {
            Rdzv::Etcd(_) => "etcd",
            Rdzv::C10d(_) => "c10d",
        };
        let mut args: Vec<String> = [
            "--rdzv-backend",
            backend,
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            &self.run_id,
            "--nnodes",
            &self.nnodes,
            "--nproc-per-node",
            nproc,
            "--rdzv-conf",
            &self.rdzv_conf,
            "--term-timeout",
            "5",
            "--local-addr",
            addr,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(["--max-restarts".into(), self.max_restarts.to_string()]);
        args.extend(self.agent_flags.iter().cloned());
        args
    }

    /// Pod `index` on loopback with `nproc` workers running `worker` (a script and its
    /// arguments), the agent given `extra` flags too.
    pub fn pod_running(&self, index: u8, nproc: u32, extra: &[&str], worker: &[String]) -> Pod {
        let addr = format!("127.0.{}.{}", self.net, index + 1);
        let mut args = self.agent_args(&self.endpoint(), &addr, &nproc.to_string());
        args.extend(extra.iter().map(|s| s.to_string()));
        args.extend(worker.iter().cloned());
        let env = [("PYTHON", python().display().to_string())];
        Pod::start(self.dir.path(), &format!("pod{index}"), &args, &env)
    }

    /// The index of the pod etcd names as the run's coordinator, read the way a user does:
    /// `fsdp-agent status --json`, matched to a pod by its address.
    pub fn coordinator(&self) -> Option<usize> {
        let (_, json, _) = status_cmd(&[
            "--json",
            "--rdzv-endpoint",
            &self.endpoint(),
            "--rdzv-id",
            &self.run_id,
        ]);
        let report: serde_json::Value = serde_json::from_str(&json).ok()?;
        let member = report["members"]
            .as_array()?
            .iter()
            .find(|m| m["node_id"] == report["coordinator"])?;
        let host: usize = member["addr"]
            .as_str()?
            .strip_prefix(&format!("127.0.{}.", self.net))?
            .parse()
            .ok()?;
        host.checked_sub(1)
    }

    pub fn step(&self) -> u32 {
        std::fs::read_to_string(self.dir.path().join("ckpt/step"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Waits until the checkpoint advances by `by` steps from now.
    pub fn progresses(&self, by: u32, pods: &[&Pod]) {
        let from = self.step();
        wait_until(
            &format!("training to advance {by} steps past {from}"),
            pods,
            || self.step() >= from + by,
        );
    }
}

pub fn starts(pod: &Pod) -> Vec<Start> {
    pod.stdout()
        .lines()
        // Unprefixed by default; `[default0]:start ...` with a prefix.
        .filter_map(|l| {
            l.strip_prefix("start ")
                .or_else(|| l.split_once("]:start ").map(|(_, rest)| rest))
        })
        .map(|rest| {
            let field = |k: &str| -> u32 {
                rest.split_whitespace()
                    .find_map(|kv| kv.strip_prefix(&format!("{k}=")))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(u32::MAX)
            };
            Start {
                world: field("world"),
                step: field("step"),
                restart: field("restart"),
            }
        })
        .collect()
}

/// The time of the first log line of `pod` containing `text` after the first containing
/// `after`, read from the agent's own timestamps (`2026-11-25T01:18:34.258708Z ...`), as
/// seconds of the day.
pub fn logged_at(pod: &Pod, after: &str, text: &str) -> Option<f64> {
    let err = pod.stderr();
    let from = err.find(after)?;
    let line = err[from..].lines().find(|l| l.contains(text))?;
    let time = line.split_whitespace().next()?.split_once('T')?.1;
    let mut parts = time.trim_end_matches('Z').split(':');
    let (h, m, s): (f64, f64, f64) = (
        parts.next()?.parse().ok()?,
        parts.next()?.parse().ok()?,
        parts.next()?.parse().ok()?,
    );
    Some(h * 3600.0 + m * 60.0 + s)
}

/// Polls `cond`; on timeout panics with every pod's output.
pub fn wait_until(what: &str, pods: &[&Pod], mut cond: impl FnMut() -> bool) {
    let end = std::time::Instant::now() + LIMIT;
    while !cond() {
        if std::time::Instant::now() > end {
            let outputs: Vec<String> = pods.iter().map(|p| p.output()).collect();
            panic!(
                "timed out after {LIMIT:?} waiting for {what}\n{}",
                outputs.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The `n`-th start line of `pod` (0-based) has this world size.
pub fn nth_start_world(pod: &Pod, n: usize, world: u32) -> bool {
    starts(pod).get(n).is_some_and(|s| s.world == world)
}
