//! The agent's word to a worker that re-forms in place (`FSDP_AGENT_CONTROL`, see
//! fsdp-agent's docs/goodput.md): a Unix datagram socket this process binds, on which its
//! agent sends each new round as `round N RANK=.. WORLD_SIZE=.. MASTER_ADDR=..` (the
//! per-round variables of torchrun's worker environment, which a running process cannot
//! have set again). Without the variable, nothing re-forms in place: the agent restarts
//! the process as torchrun would.

use std::collections::HashMap;
use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::launch::{self, Launch};

/// A new round for this process: where its next group meets and its place in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Order {
    /// The agent's round number (reported back as `joined N`).
    pub round: u64,
    pub launch: Launch,
    /// `TORCHELASTIC_RESTART_COUNT` of the new round.
    pub restart_count: u64,
}

/// Reads one datagram: `round N KEY=VALUE ...`.
pub fn parse(msg: &str) -> Result<Order, String> {
    let mut words = msg.split_whitespace();
    if words.next() != Some("round") {
        return Err(format!("not a round: '{msg}'"));
    }
    let round = words
        .next()
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("no round number in '{msg}'"))?;
    let vars: HashMap<&str, &str> = words.filter_map(|w| w.split_once('=')).collect();
    let launch = launch::from_env(&|k| vars.get(k).map(|v| (*v).to_owned()))?
        .ok_or_else(|| format!("round {round} names no RANK, WORLD_SIZE, MASTER_ADDR"))?;
    let restart_count = vars
        .get("TORCHELASTIC_RESTART_COUNT")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Ok(Order {
        round,
        launch,
        restart_count,
    })
}

/// The bound socket, and an order that arrived before the loop asked for it.
pub struct Control {
    socket: UnixDatagram,
    path: PathBuf,
    early: Option<Order>,
}

impl Control {
    /// Binds `FSDP_AGENT_CONTROL` when the agent offers it (`None` otherwise, or if the
    /// bind fails: the process is then restarted on a re-form, as it would be anyway).
    pub fn from_env() -> Option<Self> {
        let path = PathBuf::from(std::env::var_os("FSDP_AGENT_CONTROL")?);
        Self::bind(path)
            .map_err(|e| eprintln!("fsdp-trainer: warning: cannot bind the agent's control socket ({e}); a re-form restarts this process"))
            .ok()
    }

    fn bind(path: PathBuf) -> std::io::Result<Self> {
        // A socket file left by an earlier process of this local rank.
        let _ = std::fs::remove_file(&path);
        let socket = UnixDatagram::bind(&path)?;
        socket.set_nonblocking(true)?;
        Ok(Self {
            socket,
            path,
            early: None,
        })
    }

    /// The newest order that arrived, without waiting.
    pub fn poll(&mut self) -> Option<Order> {
        let mut buf = [0u8; 1024];
        while let Ok(n) = self.socket.recv(&mut buf) {
            match parse(&String::from_utf8_lossy(&buf[..n])) {
                Ok(o) => self.early = Some(o),
                Err(e) => eprintln!("fsdp-trainer: warning: ignoring the agent's word: {e}"),
            }
        }
        self.early.clone()
    }

    /// Takes the newest order that arrived, without waiting.
    pub fn take(&mut self) -> Option<Order> {
        self.poll();
        self.early.take()
    }

    /// Waits up to `limit` for an order (one already waiting is returned at once) and
    /// takes it. `stop` is asked between looks: a warning signal ends the wait early.
    pub fn wait(&mut self, limit: Duration, stop: &dyn Fn() -> bool) -> Option<Order> {
        let end = Instant::now() + limit;
        loop {
            if self.poll().is_some() {
                return self.early.take();
            }
            if stop() || Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for Control {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ORDER: &str = "round 7 RANK=5 LOCAL_RANK=1 GROUP_RANK=2 ROLE_RANK=5 LOCAL_WORLD_SIZE=2 WORLD_SIZE=8 GROUP_WORLD_SIZE=4 ROLE_WORLD_SIZE=8 MASTER_ADDR=10.0.0.1 MASTER_PORT=29511 TORCHELASTIC_RESTART_COUNT=3";

    #[test]
    fn an_order_carries_the_rounds_worker_environment() {
        let o = parse(ORDER).unwrap();
        assert_eq!(o.round, 7);
        assert_eq!(o.restart_count, 3);
        let l = o.launch;
        assert_eq!(
            (l.rank, l.world, l.local_rank, l.local_world, l.master_port),
            (5, 8, 1, 2, 29511)
        );
        assert_eq!(l.master_addr, "10.0.0.1");
        assert!(parse("round x RANK=1").is_err());
        assert!(parse("stop").is_err());
        let e = parse("round 3 RANK=1 WORLD_SIZE=2").unwrap_err();
        assert!(e.contains("MASTER_ADDR, MASTER_PORT missing"), "{e}");
    }

    #[test]
    fn the_newest_order_is_taken_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ctl");
        let mut c = Control::bind(path.clone()).unwrap();
        assert!(c.poll().is_none());
        let agent = UnixDatagram::unbound().unwrap();
        agent.send_to(b"garbage", &path).unwrap();
        agent.send_to(ORDER.as_bytes(), &path).unwrap();
        agent
            .send_to(ORDER.replace("round 7", "round 8").as_bytes(), &path)
            .unwrap();
        assert!(c.poll().is_some());
        let got = c.wait(Duration::from_secs(1), &|| false).unwrap();
        assert_eq!(got.round, 8);
        assert!(c.wait(Duration::from_millis(20), &|| false).is_none());
        assert!(c.wait(Duration::from_secs(5), &|| true).is_none());
        drop(c);
        assert!(!path.exists(), "the socket file goes with the process");
    }
}
