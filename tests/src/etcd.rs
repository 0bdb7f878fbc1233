//! A real etcd (Debian's `etcd-server`) started on free loopback ports, killable and
//! restartable with or without its data.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::free_port;

/// TLS settings for the server.
#[derive(Debug, Clone)]
pub struct ServerTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

pub struct Etcd {
    child: Option<Child>,
    pub client_port: u16,
    peer_port: u16,
    pub data_dir: PathBuf,
    _dir: tempfile::TempDir,
    tls: Option<ServerTls>,
    /// Another address etcd listens on besides 127.0.0.1 (a test bridge).
    also_on: Option<String>,
}

impl Etcd {
    pub fn start() -> Self {
        Self::start_with(None)
    }

    pub fn start_with(tls: Option<ServerTls>) -> Self {
        Self::start_from(tls, free_port(), free_port())
    }

    /// [`Etcd::start_with`] trying `client_port` and `peer_port` first.
    fn start_from(tls: Option<ServerTls>, client_port: u16, peer_port: u16) -> Self {
        let dir = tempfile::TempDir::new().expect("etcd temp dir");
        let mut e = Self {
            child: None,
            client_port,
            peer_port,
            data_dir: dir.path().join("data"),
            _dir: dir,
            tls,
            also_on: None,
        };
        // The ports were free when picked, but another test's process can take one before
        // etcd binds it (seen once in a full suite run): new ports then, a few times.
        for attempt in 1.. {
            e.spawn();
            match e.wait_ready() {
                Ok(()) => break,
                Err(log) if attempt < 5 && log.contains("address already in use") => {
                    let _ = std::fs::remove_dir_all(&e.data_dir);
                    (e.client_port, e.peer_port) = (free_port(), free_port());
                }
                Err(log) => panic!("etcd did not start: {log}"),
            }
        }
        e
    }

    /// An etcd that also listens on `addr` (e.g. a test bridge's address).
    pub fn start_also_on(addr: &str) -> Self {
        let mut e = Self::start();
        e.kill();
        e.also_on = Some(addr.to_owned());
        e.launch();
        e
    }

    /// `<addr>:<port>`: the endpoint on another address etcd listens on.
    pub fn endpoint_on(&self, addr: &str) -> String {
        format!("{addr}:{}", self.client_port)
    }

    /// The etcd process id (to freeze it).
    pub fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// Starts etcd again after [`Etcd::kill`], with the data it had.
    pub fn start_again(&mut self) {
        self.launch();
    }

    /// `127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    fn launch(&mut self) {
        self.spawn();
        if let Err(log) = self.wait_ready() {
            panic!("etcd did not start: {log}");
        }
    }

    fn spawn(&mut self) {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut client_url = format!("{scheme}://127.0.0.1:{}", self.client_port);
        if let Some(addr) = &self.also_on {
            client_url.push_str(&format!(",{scheme}://{addr}:{}", self.client_port));
        }
        let peer_url = format!("http://127.0.0.1:{}", self.peer_port);
        let log = self._dir.path().join("etcd.log");
        let mut cmd = Command::new("etcd");
        cmd.args(["--name", "test", "--data-dir"])
            .arg(&self.data_dir)
            .args([
                "--listen-client-urls",
                &client_url,
                "--advertise-client-urls",
                &client_url,
            ])
            .args([
                "--listen-peer-urls",
                &peer_url,
                "--initial-advertise-peer-urls",
                &peer_url,
            ])
            .args(["--initial-cluster", &format!("test={peer_url}")])
            .args(["--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).expect("etcd log"))
            .stderr(
                std::fs::File::options()
                    .append(true)
                    .open(&log)
                    .expect("etcd log"),
            );
        if let Some(t) = &self.tls {
            cmd.arg("--cert-file")
                .arg(&t.cert)
                .arg("--key-file")
                .arg(&t.key);
            cmd.arg("--trusted-ca-file")
                .arg(&t.ca)
                .arg("--client-cert-auth");
        }
        self.child = Some(cmd.spawn().expect("start etcd (apt install etcd-server)"));
    }

    /// Waits until etcd's own process listens on its client port (another process on that
    /// port answers a connect as well); `Err` with its log if it exited first or did not
    /// listen within 20 s.
    fn wait_ready(&mut self) -> Result<(), String> {
        let end = Instant::now() + Duration::from_secs(20);
        loop {
            let exited = self
                .child
                .as_mut()
                .is_some_and(|c| c.try_wait().ok().flatten().is_some());
            if exited {
                return Err(self.log());
            }
            let pid = self.child.as_ref().map_or(0, Child::id);
            if crate::listens_on(pid, self.client_port) {
                // The port opens slightly before etcd serves; a short settle avoids a
                // first request racing leader election.
                std::thread::sleep(Duration::from_millis(200));
                return Ok(());
            }
            if Instant::now() >= end {
                return Err(self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("etcd.log")).unwrap_or_default()
    }

    /// SIGKILL, as a crash.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts again on the same ports, keeping or wiping the data directory.
    pub fn restart(&mut self, keep_data: bool) {
        self.kill();
        if !keep_data {
            let _ = std::fs::remove_dir_all(&self.data_dir);
        }
        self.launch();
    }

    pub fn dir(&self) -> &Path {
        self._dir.path()
    }

    /// Runs `op` with a client of this etcd, as an outsider (a forger, an operator).
    pub fn with_client<T, F>(&self, op: impl FnOnce(etcd_client::Client) -> F) -> T
    where
        F: std::future::Future<Output = T>,
    {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async {
                let c = etcd_client::Client::connect([self.endpoint()], None)
                    .await
                    .unwrap();
                op(c).await
            })
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seen in CI: a port handed out free was taken by another test's etcd before this one
    /// bound it. The harness took the other's answer on the port for this etcd's, this one
    /// exited, and the test froze a dead process while its agent talked to the other
    /// etcd. An etcd is ready only when its own process listens on its client port.
    #[test]
    fn a_client_port_another_process_listens_on_is_not_taken_for_this_etcds() {
        let other = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let taken = other.local_addr().unwrap().port();
        let e = Etcd::start_from(None, taken, free_port());
        assert_ne!(
            e.client_port, taken,
            "the other process's port taken as this etcd's"
        );
        assert!(
            crate::listens_on(e.pid() as u32, e.client_port),
            "etcd {} does not listen on its client port {}",
            e.pid(),
            e.client_port
        );
    }
}
