//! Progress reports to the agent (`FSDP_AGENT_PROGRESS`, see fsdp-agent's docs/hangs.md):
//! a datagram per finished step and around each checkpoint, so the agent can tell a hung
//! group from a slow one. Without the variable, or if a send fails, nothing happens.

use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;

pub struct Progress {
    socket: Option<(UnixDatagram, PathBuf)>,
    rank: usize,
}

impl Progress {
    pub fn from_env(rank: usize) -> Self {
        match std::env::var_os("FSDP_AGENT_PROGRESS") {
            Some(p) => Self::to(PathBuf::from(p), rank),
            None => Self { socket: None, rank },
        }
    }

    /// Reports to the socket at `path`.
    fn to(path: PathBuf, rank: usize) -> Self {
        // Non-blocking: a busy agent drops a report; it never stalls training.
        let socket = UnixDatagram::unbound()
            .ok()
            .filter(|s| s.set_nonblocking(true).is_ok())
            .map(|s| (s, path));
        Self { socket, rank }
    }

    /// Sends one report, trying `tries` times 2 ms apart while the agent's queue is full.
    fn say(&self, what: &str, tries: u32) {
        let Some((s, path)) = &self.socket else {
            return;
        };
        let msg = format!("{} {what}", self.rank);
        for _ in 0..tries {
            match s.send_to(msg.as_bytes(), path) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                _ => return,
            }
        }
    }

    /// Tells the agent what this rank can do: `save-on-warning` says a SIGUSR1 makes it
    /// save a checkpoint at the next step and stop, so its agent warns it, instead of
    /// stopping it, before a re-form that loses no node.
    pub fn can(&self, what: &str) {
        self.say(&format!("can {what}"), 50);
    }

    /// Says this rank joined the process group of the agent's round `round` (an in-place
    /// re-form) and restored its state from `from` (`memory`, or `disk`: the fallback).
    pub fn joined(&self, round: u64, from: &str) {
        self.say(&format!("joined {round} {from}"), 50);
    }

    /// Step `n` finished; this rank worked `busy` of it (not blocked on its peers), when
    /// it can tell.
    pub fn step(&self, n: usize, busy: Option<std::time::Duration>) {
        match busy {
            Some(b) => self.say(&format!("step {n} {:.6}", b.as_secs_f64()), 1),
            None => self.say(&format!("step {n}"), 1),
        }
    }

    // A phase's begin and end matter more than one step: they wait up to ~0.1 s for room.
    pub fn begin(&self, phase: &str) {
        self.say(&format!("begin {phase}"), 50);
    }

    pub fn end(&self, phase: &str) {
        self.say(&format!("end {phase}"), 50);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_and_checkpoints_reach_the_agent_in_its_format() {
        let path =
            std::env::temp_dir().join(format!("fsdp-trainer-progress-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let agent = UnixDatagram::bind(&path).unwrap();
        let p = Progress::to(path.clone(), 3);
        p.step(41, Some(std::time::Duration::from_micros(83_250)));
        p.step(42, None);
        p.begin("checkpoint");
        p.end("checkpoint");
        p.can("save-on-warning");
        let mut got = Vec::new();
        let mut buf = [0u8; 64];
        for _ in 0..5 {
            let n = agent.recv(&mut buf).unwrap();
            got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
        assert_eq!(
            got,
            [
                "3 step 41 0.083250",
                "3 step 42",
                "3 begin checkpoint",
                "3 end checkpoint",
                "3 can save-on-warning"
            ]
        );
        std::fs::remove_file(&path).unwrap();
        // Without an agent nothing is sent and nothing fails.
        Progress::to(path, 0).step(1, None);
    }
}
