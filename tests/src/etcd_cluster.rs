//! A real three-member etcd cluster on loopback, to kill members of.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::free_port;

struct Member {
    name: String,
    client_port: u16,
    child: Option<Child>,
    /// How it was started, to start it again on the same ports and data.
    args: Vec<String>,
}

pub struct EtcdCluster {
    members: Vec<Member>,
    dir: tempfile::TempDir,
}

impl EtcdCluster {
    /// Starts `n` members and waits until each one's own process listens on its client
    /// port. A member that exits at start (a port `free_port` handed out was taken again
    /// meanwhile, on a busy machine) makes a new cluster on new ports; one that neither
    /// starts nor exits within 60 s fails the test with its log.
    pub fn start(n: usize) -> Self {
        for _ in 0..3 {
            if let Some(c) = Self::try_start(n) {
                return c;
            }
        }
        panic!("an etcd cluster of {n} could not start in three tries (see the logs above)");
    }

    fn try_start(n: usize) -> Option<Self> {
        let dir = tempfile::TempDir::new().expect("etcd cluster dir");
        let peers: Vec<(String, u16, u16)> = (0..n)
            .map(|i| (format!("m{i}"), free_port(), free_port()))
            .collect();
        let initial = peers
            .iter()
            .map(|(name, _, peer)| format!("{name}=http://127.0.0.1:{peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut members = Vec::new();
        for (name, client, peer) in &peers {
            let client_url = format!("http://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let data = dir.path().join(name).display().to_string();
            let token = format!("t{}", std::process::id());
            let args: Vec<String> = [
                "--name",
                name,
                "--data-dir",
                &data,
                "--listen-client-urls",
                &client_url,
                "--advertise-client-urls",
                &client_url,
                "--listen-peer-urls",
                &peer_url,
                "--initial-advertise-peer-urls",
                &peer_url,
                "--initial-cluster",
                &initial,
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                &token,
                "--log-level",
                "warn",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            let mut m = Member {
                name: name.clone(),
                client_port: *client,
                child: None,
                args,
            };
            m.launch(dir.path());
            members.push(m);
        }
        let mut c = Self { members, dir };
        let end = Instant::now() + Duration::from_secs(60);
        for i in 0..c.members.len() {
            // Its own process listening, not any: another test's etcd on a port handed
            // out free answers a connect as well (`Etcd`'s test).
            let (pid, port) = (
                c.members[i].child.as_ref().map_or(0, Child::id),
                c.members[i].client_port,
            );
            while !crate::listens_on(pid, port) {
                let log = c.dir.path().join(format!("{}.log", c.members[i].name));
                let exited = c.members[i]
                    .child
                    .as_mut()
                    .is_some_and(|ch| ch.try_wait().ok().flatten().is_some());
                let log = std::fs::read_to_string(log).unwrap_or_default();
                if exited {
                    eprintln!("etcd member {} exited at start:\n{log}", c.members[i].name);
                    return None;
                }
                assert!(
                    Instant::now() < end,
                    "etcd member {} did not start:\n{log}",
                    c.members[i].name
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Some(c)
    }

    /// Every member's client endpoint, in member order.
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client_port))
            .collect()
    }

    fn member(&mut self, endpoint: &str) -> &mut Member {
        self.members
            .iter_mut()
            .find(|m| format!("127.0.0.1:{}", m.client_port) == endpoint)
            .expect("a member of this cluster")
    }

    /// SIGKILL of the member whose endpoint is `endpoint`.
    pub fn kill(&mut self, endpoint: &str) {
        if let Some(mut c) = self.member(endpoint).child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts a killed member again, with its data.
    pub fn start_again(&mut self, endpoint: &str) {
        let dir = self.dir.path().to_path_buf();
        self.member(endpoint).launch(&dir);
    }

    /// Every member's log.
    pub fn logs(&self) -> String {
        self.members
            .iter()
            .map(|m| {
                let log = std::fs::read_to_string(self.dir.path().join(format!("{}.log", m.name)));
                format!("=== {}\n{}", m.name, log.unwrap_or_default())
            })
            .collect()
    }
}

impl Member {
    fn launch(&mut self, dir: &std::path::Path) {
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(dir.join(format!("{}.log", self.name)))
            .unwrap();
        let child = Command::new("etcd")
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start etcd (apt install etcd-server)");
        self.child = Some(child);
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for m in &mut self.members {
            if let Some(mut c) = m.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}
